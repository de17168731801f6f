"""`python -m mpexp.cache [overrides]` (or `mpexp-cache`): build an image folder's resized
stores (`dataset.cache=resized`, mpexp/data/image_cache.py) before any training job, e.g. once
before a sweep whose jobs then only read them:

    python -m mpexp.cache dataset.path=~/data/imagenet dataset.num_workers=16

The overrides are a training run's (`dataset=image_folder` is the default here); only the dataset's
keys matter: the folder, the sizes (`image_size`, `resize_size`, `cache_side`, `crop_scale`), the
cache folder, and the workers that decode. It prints each split's store. A job started meanwhile
waits for the build and reads what it built.
"""

from __future__ import annotations

import logging
import sys

from mpexp.command_log import messages_on_stderr
from mpexp.errors import ConfigError, UserError

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    try:
        with messages_on_stderr():
            for store in stores(overrides):
                print(store)
    except UserError as err:
        print(f"mpexp-cache: {err}", file=sys.stderr)
        return 2
    return 0


def stores(overrides: list[str]) -> list:
    """Build (where missing) the stores of the image folder `overrides` describe; their paths."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from mpexp import config
    from mpexp.build import build
    from mpexp.data.image_folder import ImageFolderData
    from mpexp.resolvers import register_resolvers
    from mpexp.validate import validate

    config.register()
    register_resolvers()
    if not any(arg.startswith(("dataset=", "experiment=")) for arg in overrides):
        overrides = ["dataset=image_folder", *overrides]
    try:
        with initialize_config_dir(str(config.config_dir()), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
    except HydraException as err:
        raise ConfigError(str(err)) from None
    validate(cfg)
    data = build(cfg.dataset)
    if not isinstance(data, ImageFolderData):
        raise ConfigError(
            f"mpexp-cache builds an image folder's cache, and dataset={cfg.dataset._target_} is "
            "none: give dataset=image_folder (the default here) and its dataset.path."
        )
    return data.build_cache()


if __name__ == "__main__":
    sys.exit(main())
