"""Telling a local path from a Hub id ("name" or "owner/name"), for models and data sets alike."""
import os
from pathlib import Path


def looks_local(name_or_path: str) -> bool:
    """Whether `name_or_path` was meant as a local path: it exists, is absolute or relative (".", "~"), uses a
    Windows separator, or has more parts than a Hub id. A missing local path then fails at once, with no download."""
    return (os.path.exists(name_or_path) or os.path.isabs(name_or_path) or name_or_path.startswith((".", "~"))
            or "\\" in name_or_path or name_or_path.count("/") > 1)


ASSETS = Path(__file__).resolve().parent / "assets"  # the bundled tiny model and demo data


def register_asset_resolver() -> None:
    """`${asset:NAME}` in Hydra configs: the path of a file or directory bundled in lorafuse/assets."""
    from omegaconf import OmegaConf  # the recipes' dependency, not the kernels'

    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda name: str(ASSETS / name))
