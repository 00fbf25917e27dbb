"""The single schema of a shardpool run: an axolotl-style YAML with a ``shardpool:`` block.

Keys shared with axolotl mean what they mean in axolotl. Validation is strict and complete: every
unknown key, wrong type, impossible combination and axolotl key that would change the run without
being built is reported at once, each in one line that names the key and the fix. axolotl keys
that change nothing (``strict: false``, an empty ``wandb_project:``) are accepted. Nothing runs
before a config passes, and nothing here imports torch.

* :mod:`.schema`: the keys shardpool implements (:class:`Config`) and the rules across them;
* :mod:`.axolotl_keys`: every other axolotl key, and when it is accepted;
* :mod:`.parsing`: :func:`load_config` and :func:`parse_config`;
* :mod:`.optimizers`: which optimizer a device gets for a config's ``optimizer``.
"""

from shardpool.config.axolotl_keys import AXOLOTL_KEYS, AxolotlKey
from shardpool.config.parsing import load_config, parse_config
from shardpool.config.schema import BnbConfig, Config, DatasetSpec, ShardpoolSection

__all__ = [
    "Config",
    "DatasetSpec",
    "BnbConfig",
    "ShardpoolSection",
    "load_config",
    "parse_config",
    "AXOLOTL_KEYS",
    "AxolotlKey",
]
