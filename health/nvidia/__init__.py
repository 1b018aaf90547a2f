"""NVIDIA GPU probes: parsers over nvidia-smi, the kernel log (Xid), dcgmi diag and nccl-tests
output, and thin runners.

One module a tool: ``smi``, ``xid``, ``dcgmi`` and ``nccl_tests`` hold its parser, ``probe``
the runners. Every ``check_*`` (and ``classify_xids``) is a pure parser: text in, ``Finding``s out; it never
raises, and empty, truncated or unrecognised output is ``probe_failed`` (UNKNOWN), never healthy.
The runners (``probe_*``, ``run_all``) only run a tool (an argv list, a timeout, never a shell)
and hand its output to the parser. Formats, field meanings and actions follow
``docs/probe-formats.md`` §2 (nccl-tests src/util.cu and common.cu, NVIDIA/DCGM dcgmi/Diag.cpp, the
Xid buckets of NVIDIA's r590 Xid catalog as used by awsome-distributed-training's health checks).

==============  ============================  =================================================  ===========
probe           reads                         rule -> status                                     action
==============  ============================  =================================================  ===========
nvidia-smi      ``--query-gpu=`` CSV (the     fewer GPUs than ``expected_gpus`` -> UNHEALTHY     REPLACE
                ``GPU_QUERY_FIELDS``, with    more than expected -> DEGRADED (wrong              NONE
                or without header/units;      expectation); per GPU:
                ``[N/A]``/``[Not Supported]`` ``ecc.errors.uncorrected.volatile.total`` > 0
                = no data, rule skipped)      -> UNHEALTHY (a reset retires/remaps the memory)   REBOOT
                                              ``retired_pages.pending`` = Yes -> UNHEALTHY       REBOOT
                                              ``ecc.errors.uncorrected.aggregate.total`` > 0 or
                                              ``retired_pages.dbe`` > 0 -> UNHEALTHY (lifetime
                                              counts no reboot clears; ADT isolates on dbe)      REPLACE
                                              ``retired_pages.sbe`` > ``SBE_RETIRED_DEGRADED``,
                                              ECC disabled, ``hw_slowdown`` Active -> DEGRADED   NONE
                                              a lost GPU, no driver, or no GPU at all and no
                                              expected count -> UNHEALTHY                        REBOOT
remapped-rows   ``--query-remapped-rows=``    ``remapped_rows.failure`` = Yes -> UNHEALTHY       REPLACE
                CSV (``REMAPPED_ROWS_         ``remapped_rows.pending`` = Yes -> UNHEALTHY       REBOOT
                FIELDS``)                     (the remap takes effect at the next GPU reset)
                                              remapped rows without pending/failure: recorded    NONE
xid             a kernel log (dmesg) with     each Xid through ``XID_ACTIONS`` (one table,
                ``NVRM: Xid (PCI:...): N,``   below); an unknown code -> DEGRADED; one finding   per row
                lines                         per code and PCI address, which it quotes
dcgmi-diag      ``dcgmi diag -r N`` table     a failed test -> UNHEALTHY with the test, GPUs
                (DCGM 3.x aggregated          and message: Deployment (software) tests           REBOOT
                ``Fail - GPU: 0``, 4.x        Hardware/Integration/Stress tests                  REPLACE
                ``GPU0: Fail`` rows) or       (a message saying a remap/retirement is pending    REBOOT;
                ``-j`` JSON (3.x and 4.x      exit 205, ISOLATE, makes every failure             REPLACE)
                keys)                         a warning (``Warn``) -> DEGRADED                   NONE
                                              exit 235/242/other with no failure -> UNKNOWN
nccl-tests      ``all_reduce_perf`` output    ``Test NCCL failure`` / ``Test CUDA failure`` /
                (srun ``-l`` and OpenMPI      ``Test failure`` lines -> UNHEALTHY                REBOOT
                prefixes stripped)            ``#wrong`` > 0 in any row or "Out of bounds
                                              values : N FAILED" -> UNHEALTHY (corruption)       REPLACE
                                              busbw at the LARGEST size (the lower of the
                                              out-of-place and in-place columns; never "Avg
                                              bus bandwidth") under the floor
                                              (``max(min_busbw_gbps, baseline * tolerance)``)
                                              -> DEGRADED                                        NONE
==============  ============================  =================================================  ===========

The Xid table ``XID_ACTIONS`` (code: meaning -> status/action). Slurm cannot reset one GPU, so
the catalog's "GPU reset" and "node reboot" buckets are both REBOOT here; "reboot, then replace
if it comes back" is the operator's (or supervisor's) escalation, not this module's:

- UNHEALTHY/REPLACE: 54 (auxiliary power / mechanical: ISOLATE in the catalog).
- UNHEALTHY/REBOOT (drain): 48 double-bit ECC error; 64 row-remapping failure; 71 and 74 NVLink
  errors; 79 GPU fallen off the bus; 95 uncontained ECC error; 109 context-switch timeout;
  110 security fault; 119 GSP RPC timeout; 120 GSP error; 136, 140, 143, 155, 156, 158 (the
  catalog's GPU-reset bucket); 151 and 168 (bare-metal restart / boot re-attempt); 154 when its
  text asks for a reset, a reboot or a drain.
- DEGRADED/RESTART (an application fault: restart the job, never a drain): 13 graphics engine
  exception, 31 GPU memory page fault, 43 GPU stopped processing (the faulting channel was
  reset), 45 preemptive cleanup after an earlier error, 94 contained ECC error, 126.
- DEGRADED (watch, not a drain by itself): 63 ECC page retirement / row remap recorded (takes
  effect at the next reset: the remapped-rows query says whether it is pending; action REBOOT as a
  hint only: a DEGRADED finding never drains); 92 high single-bit ECC error rate; any code not in
  the table; 154 whose new recovery action is "None".

63, 92 and 94 are memory events but not drains: docs/probe-formats.md §2.3 (none of them alone
drains a node) and the catalog's buckets (63 and 92 IGNORE, 94 RESTART_APP) say so; the memory
itself is judged by the ECC counters and the remapped-rows query above, which do drain.

Tools and the exact argv (looked up in ``$TSUP_HEALTH_TOOLS`` first, then ``PATH``):

- ``nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv`` (10 s); on a driver that predates
  ``clocks_event_reasons`` ("is not a valid field to query") once more with
  ``clocks_throttle_reasons.hw_slowdown``.
- ``nvidia-smi --query-remapped-rows=<REMAPPED_ROWS_FIELDS> --format=csv`` (10 s); GPUs without
  row remapping (pre-Ampere) print N/A or say "not supported": HEALTHY, nothing to judge.
- ``dcgmi diag -r <level> -j`` (only with ``run_dcgmi``), ``DCGMI_TIMEOUT_S[level]``.
- ``all_reduce_perf -b 32M -e 1G -f 2 -g <GPUs> -w 5 -n 20`` (nccl-tests, only with
  ``run_bandwidth``), 50 s: judged at 1 GiB. Without nccl-tests, ``python -m health.allreduce``
  under torchrun measures the same bus bandwidth with torch.distributed.

Only nvidia-smi decides whether the node has NVIDIA GPUs (absent: ``no_devices``); with
nvidia-smi present, a missing dcgmi or all_reduce_perf that was asked for is UNKNOWN, and so is a
non-zero exit after output that parsed healthy.
"""

from health.nvidia.dcgmi import DCGMI_EXIT_CODES, check_dcgmi_diag
from health.nvidia.nccl_tests import check_nccl_tests
from health.nvidia.probe import (
    DCGMI_TIMEOUT_S,
    NCCL_TESTS_ARGS,
    NCCL_TESTS_ITERS,
    NCCL_TESTS_TIMEOUT_S,
    NVIDIA_SMI_TIMEOUT_S,
    probe_dcgmi,
    probe_nccl_tests,
    probe_nvidia_smi,
    run_all,
)
from health.nvidia.smi import (
    GPU_QUERY_FIELDS,
    REMAPPED_ROWS_FIELDS,
    SBE_RETIRED_DEGRADED,
    check_nvidia_smi,
    check_remapped_rows,
)
from health.nvidia.xid import (
    XID_ACTIONS,
    XID_PATTERN,
    XID_PLAIN_PATTERN,
    XidRule,
    classify_xids,
    xid_of,
    xid_rule,
)

__all__ = [
    "DCGMI_EXIT_CODES", "DCGMI_TIMEOUT_S", "GPU_QUERY_FIELDS", "NCCL_TESTS_ARGS", "NCCL_TESTS_ITERS",
    "NCCL_TESTS_TIMEOUT_S", "NVIDIA_SMI_TIMEOUT_S", "REMAPPED_ROWS_FIELDS", "SBE_RETIRED_DEGRADED",
    "XID_ACTIONS", "XID_PATTERN", "XID_PLAIN_PATTERN", "XidRule", "check_dcgmi_diag", "check_nccl_tests",
    "check_nvidia_smi", "check_remapped_rows", "classify_xids", "probe_dcgmi", "probe_nccl_tests",
    "probe_nvidia_smi", "run_all", "xid_of", "xid_rule",
]
