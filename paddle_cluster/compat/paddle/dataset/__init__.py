"""``paddle.dataset``: the seeds' datasets (``uci_housing``, ``movielens``, ``imikolov``) with PaddlePaddle's record
formats, cache layout (``common.DATA_HOME``) and checked downloads."""

from ...missing import module_getattr
from . import common, imikolov, movielens, uci_housing

__all__ = ["common", "imikolov", "movielens", "uci_housing"]
__getattr__ = module_getattr(__name__, "paddle.dataset")
