"""Models: one module each. Every model takes in_channels, num_classes and image_size (h, w)."""
