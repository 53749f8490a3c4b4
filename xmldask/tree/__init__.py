"""The hierarchical spectral label tree (Mineiro and Karampatziakis 2015): a filter from a row to a
small set of candidate labels, grown level by level over row blocks.

:func:`grow_tree` builds the arrays; :class:`SpectralLabelTree` is the estimator (fit, route,
figures, save, load).
"""

from ._kernels import leaf_of, route_pairs, rows_by_node
from .growth import GrownTree, grow_tree
from .model import TREE_VERSION, SpectralLabelTree

__all__ = ["TREE_VERSION", "GrownTree", "SpectralLabelTree", "grow_tree", "leaf_of", "route_pairs", "rows_by_node"]
