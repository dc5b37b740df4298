"""The wrapper: ``DataParallel`` composes the pipeline (plan, scatter, replicate,
parallel_apply, gather) through torch's overridable methods; ``data_parallel`` is its
functional form.

Beside the class (``_data_parallel``), one job each: options checked on assignment
(``_options``), the device check (``_placement``), the count ``num_items_in_batch`` found and
marked for each replica (``_partial_sums``), read-through to the module (``_read_through``),
mmcv's step methods (``_steps``), ``last_call`` and ungathered outputs (``_results``), and the
module's signature presented to introspection (``_signature``), and ``check=``, the
comparison with one device (``_one_device``).

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

from dataparallel.wrapper._check_option import OneDeviceDifference
from dataparallel.wrapper._data_parallel import DataParallel
from dataparallel.wrapper._functional import data_parallel
from dataparallel.wrapper._results import CallStats, DeviceOutputs

__all__ = ["CallStats", "DataParallel", "DeviceOutputs", "OneDeviceDifference", "data_parallel"]
