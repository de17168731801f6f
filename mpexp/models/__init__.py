"""Models: one module each. Image classifiers take in_channels, num_classes and image_size (h, w);
language models take vocab_size (mpexp/tasks/ says which a dataset's batches need)."""
