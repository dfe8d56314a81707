"""jdls: dynamic loss scaling for mixed-precision training in JAX and optax."""

from jdls import fp8, linen, nnx, presets, rules
from jdls._floats.formats import FloatFormat, FormatInfo, cbfloat16
from jdls._floats.lookup import finfo
from jdls._floats.policy import Policy, get_policy
from jdls._floats.storage import compress, decompress
from jdls._numerics.checks import all_finite
from jdls._scales.layer_scales import layer_scaled_value_and_grad
from jdls._scales.layer_site import LayerScale, layer_site, rescale_boundary
from jdls._scales.loss_adjust import adjust_loss_scales
from jdls._scales.multi_loss import multi_loss_value_and_grad
from jdls._scales.scale import AdaptiveScale, DynamicScale, LossScale, NoOpScale, StaticScale
from jdls._sites.apply import apply_site
from jdls._sites.dropped import SiteNotDifferentiated
from jdls._sites.probe import Probe
from jdls._sites.site import Site, SiteKind, is_site
from jdls._sites.telemetry import Telemetry, plot_headroom
from jdls._sites.update import merge_sites, split_sites, update_sites
from jdls._transforms.accumulate import AccumulateInfo, accumulate
from jdls._transforms.apply import apply_updates
from jdls._transforms.clip import clip
from jdls._transforms.groups import GroupState, group_stats, wrap_groups
from jdls._transforms.retry import SkipCause
from jdls._transforms.retrying import retrying
from jdls._transforms.stats import (
    Stats,
    WrapState,
    get_scale,
    keep_if_skipped,
    nonfinite_paths,
    set_scale,
    skip_cause,
    stats,
)
from jdls._transforms.wrap import wrap
from jdls.rules import MinimumScaleError

__version__ = "0.1.0"

__all__ = [
    "AccumulateInfo",
    "AdaptiveScale",
    "DynamicScale",
    "FloatFormat",
    "FormatInfo",
    "GroupState",
    "LayerScale",
    "LossScale",
    "MinimumScaleError",
    "NoOpScale",
    "Policy",
    "Probe",
    "Site",
    "SiteKind",
    "SiteNotDifferentiated",
    "SkipCause",
    "StaticScale",
    "Stats",
    "Telemetry",
    "WrapState",
    "accumulate",
    "adjust_loss_scales",
    "all_finite",
    "apply_site",
    "apply_updates",
    "cbfloat16",
    "clip",
    "compress",
    "decompress",
    "finfo",
    "fp8",
    "get_policy",
    "get_scale",
    "group_stats",
    "is_site",
    "keep_if_skipped",
    "layer_scaled_value_and_grad",
    "layer_site",
    "linen",
    "merge_sites",
    "multi_loss_value_and_grad",
    "nnx",
    "nonfinite_paths",
    "plot_headroom",
    "presets",
    "rescale_boundary",
    "retrying",
    "rules",
    "set_scale",
    "skip_cause",
    "split_sites",
    "stats",
    "update_sites",
    "wrap",
    "wrap_groups",
]


def __getattr__(name: str) -> object:
    """``equinox``, the optional Equinox face, imported on first use (Equinox is not a
    dependency): ``jdls.equinox`` works after ``import jdls`` where Equinox is installed."""
    if name == "equinox":
        import importlib

        return importlib.import_module(f"{__name__}.equinox")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
