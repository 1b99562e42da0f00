"""megamoe: a readable eager reference of the fused SM90 Mega MoE layer, beside the real kernels."""

from .geometry import PRESETS, Geometry, get_geometry
from .inputs import MoEInputs, make_inputs
from .recipe import RECIPES, Recipe, get_recipe
from .testing import calc_diff
from .weights import FP8BlockWeights, MXFP4Weights, random_mxfp4_weights

__version__ = "0.1.0"
__all__ = [
    "PRESETS", "Geometry", "get_geometry", "RECIPES", "Recipe", "get_recipe", "MoEInputs", "calc_diff",
    "make_inputs", "FP8BlockWeights", "MXFP4Weights", "random_mxfp4_weights",
]
