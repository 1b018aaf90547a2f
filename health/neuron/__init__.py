"""Neuron (Trainium / Inferentia) probes: parsers over the Neuron tools' output, and thin runners.

One module a tool: ``ls``, ``monitor``, ``nccom`` and ``logs`` hold its parser, ``probe`` the
runners. Every ``check_*`` is a pure parser: text in, ``Finding``s out; it never raises, and empty,
truncated or unrecognised output is ``probe_failed`` (UNKNOWN), never healthy. The runners
(``probe_*``, ``run_all``) only run a tool (an argv list, a timeout, never a shell) and hand
its output to the parser. Formats, field meanings and actions follow
``docs/probe-formats.md`` §1 (the Neuron SDK docs: neuron-ls.rst, neuron-monitor-user-guide.rst,
nccom-test.rst, nrt-troubleshoot.rst, the Neuron node-problem-detector rules).

==============  ==========================  ===================================================  ===========
probe           reads                       rule -> status                                       action
==============  ==========================  ===================================================  ===========
neuron-ls       ``neuron-ls`` JSON (``-j``  devices (and NeuronCores) against the expectation
                or ``--output-format        (``expected_devices``/``_cores``, else
                json``), else the table     ``INSTANCE_TYPES`` for the instance type given or
                (old and new column sets,   printed): fewer, or a gap in the device indices
                ``--topology``)             -> UNHEALTHY (HyperPod's agent reboots on a count     REBOOT
                                            mismatch); more than expected -> DEGRADED (the
                                            expectation is wrong)                                NONE
neuron-monitor  the first complete JSON     ``neuron_hardware_info.error`` set (no driver), or
                report (pretty JSON or      fewer devices than the instance type -> UNHEALTHY    REBOOT
                JSON lines)                 ``mem_ecc_uncorrected`` / ``sram_ecc_uncorrected``
                                            > 0 on a device -> UNHEALTHY                         REPLACE
                                            ``mem_ecc_repairable_uncorrected`` > 0 -> UNHEALTHY  REBOOT
                                            ``error_summary.hardware`` > 0 -> UNHEALTHY          REPLACE
                                            corrected ECC >= ``ECC_CORRECTED_DEGRADED`` on a
                                            device, ``execution_summary.timed_out`` > 0, a
                                            runtime it could not read -> DEGRADED                NONE
                                            hw counters unreadable -> UNKNOWN                    NONE
nccom-test      the all-reduce table        busbw at the LARGEST size (never "Avg bus
                (spaces or tabs,            bandwidth") under the floor (``min_busbw_gbps``,
                ``time(us)`` or             ``baseline_gbps * tolerance``: the higher)
                ``time:avg(us)``, optional  -> DEGRADED                                          NONE
                ``algorithm`` column) or    under ``far_below`` x the floor -> UNHEALTHY
                ``--report-to-json-file``   (HyperPod's deep check replaces such a node)         REPLACE
                JSON                        "Neuron DKMS Driver is not running!", "Failure
                                            running neuron-bench", "N errors found - test
                                            failed" -> UNHEALTHY                                 REBOOT
neuron-log      a runtime log or a kernel   each line against ``SIGNATURES`` (one table)         per row
                log (dmesg), as text
==============  ==========================  ===================================================  ===========

The log table ``SIGNATURES`` (first column of the row = its ``name``), status -> meaning:

- UNHEALTHY/REPLACE: hardware faults the Neuron docs answer with "terminate this instance": SRAM
  and HBM uncorrectable errors (NRT 1202, 1201), DMA abort (1203), a hang on compute
  ("execution timeout ... waiting for execution completion notification"), and every kernel
  ``NEURON_HW_ERR=`` line (SRAM/NC/HBM uncorrectable, DMA error; "permanent" in the NPD rules).
- UNHEALTHY/REBOOT: the repairable HBM error (NRT 1205: "reload the neuron driver or reboot"),
  a driver that is missing or not running, an unknown ``NEURON_HW_ERR`` type.
- DEGRADED/NONE: the node may be involved but cannot be blamed from its own log: a hang in
  collectives (NRT 1200, "missing collectives status": the doc says find the faulty PEER),
  "connection closed by remote peer", EFA/OFI initialisation failures, NRT_TIMEOUT, a generic
  NRT_EXEC_COMPLETED_WITH_ERR / NRT_HW_ERROR (look for the specific message), NeuronCores held
  by another process. Worth a look; never a drain.
- HEALTHY/NONE: recognised and not the node's fault: retrying timeouts while a peer compiles,
  the benign EFA ``DEREG_MR`` after a process exit, and job/configuration errors (bad
  collective layout, libnccom path, FI_EFA_FORK_SAFE, "Too many open files", DGE
  notifications, software NRT codes such as NRT_EXEC_OOB and NRT_EXEC_SW_NQ_OVERFLOW 1204).

Lines that match nothing produce nothing; a log with no known signature gives one HEALTHY
finding ("no known error signature"). A probe never remembers: "reboot, then replace if it
comes back" is the operator's (or the supervisor's) escalation, not this module's.

Tools and the exact argv (looked up in ``$TSUP_HEALTH_TOOLS`` first, then ``PATH``):

- ``neuron-ls --output-format json`` (Neuron >= 2.34), then ``neuron-ls --json-output`` (older),
  then ``neuron-ls`` (the table), 10 s each; the first that exits 0 with output is parsed.
- ``neuron-monitor`` (no config: every metric group, a report every 5 s); read until the first
  complete JSON report, then killed; 15 s at most.
- ``nccom-test -r <NeuronCores> -b 32MB -e 256MB -f 2 -n 5 -w 2 -d fp32 allr`` (only with
  ``run_bandwidth``), 50 s; bandwidth is judged at 256 MB, the largest size (docs/probe-formats.md §1.3).
  A largest size under 32 MiB is latency-bound: under the floor there is at most DEGRADED.

Only neuron-ls decides whether the node has Neuron devices (absent: ``no_devices``); with
neuron-ls present, a missing neuron-monitor or nccom-test is UNKNOWN (the probe asked for
could not run), and so is a non-zero exit after output that parsed healthy.
"""

from health.neuron.logs import NRT_CODES, SIGNATURES, Signature, classify_log
from health.neuron.ls import DEFAULT_LNC, INSTANCE_TYPES, check_neuron_ls
from health.neuron.monitor import ECC_CORRECTED_DEGRADED, check_neuron_monitor
from health.neuron.nccom import FAR_BELOW, JUDGED_SIZE, check_nccom_test
from health.neuron.probe import (
    NCCOM_TEST_ARGS,
    NCCOM_TEST_TIMEOUT_S,
    NEURON_LS_TIMEOUT_S,
    NEURON_MONITOR_TIMEOUT_S,
    probe_nccom_test,
    probe_neuron_ls,
    probe_neuron_monitor,
    read_first_report,
    run_all,
)

__all__ = [
    "DEFAULT_LNC", "ECC_CORRECTED_DEGRADED", "FAR_BELOW", "INSTANCE_TYPES", "JUDGED_SIZE",
    "NCCOM_TEST_ARGS", "NCCOM_TEST_TIMEOUT_S", "NEURON_LS_TIMEOUT_S", "NEURON_MONITOR_TIMEOUT_S",
    "NRT_CODES", "SIGNATURES", "Signature", "check_nccom_test", "check_neuron_ls",
    "check_neuron_monitor", "classify_log", "probe_nccom_test", "probe_neuron_ls",
    "probe_neuron_monitor", "read_first_report", "run_all",
]
