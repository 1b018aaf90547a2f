"""The runtime's and the kernel's log lines, judged by one signature table (a pure parser)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from health.model import Action, Finding, Status, excerpt, probe_failed


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    pattern: re.Pattern[str]
    status: Status
    action: Action
    meaning: str


# NRT status codes (nrt_status.rst) that the runtime logs by name ("Failure: NRT_EXEC_OOB in
# nrt_execute()") or by number ("completed with err: 5"): code -> (name, status, action, meaning).
NRT_CODES: dict[int, tuple[str, Status, Action, str]] = {
    5: ("NRT_TIMEOUT", Status.DEGRADED, Action.NONE, "an execution timed out (a hang here or on a peer)"),
    6: ("NRT_HW_ERROR", Status.DEGRADED, Action.NONE,
        "hardware error reported: look for the specific message"),
    1002: ("NRT_EXEC_BAD_INPUT", Status.HEALTHY, Action.NONE, "bad input to the model: a job error"),
    1003: ("NRT_EXEC_COMPLETED_WITH_NUM_ERR", Status.HEALTHY, Action.NONE, "numerical error: a job error"),
    1004: ("NRT_EXEC_COMPLETED_WITH_ERR", Status.DEGRADED, Action.NONE,
           "execution completed with an error: look for the specific message"),
    1005: ("NRT_EXEC_NC_BUSY", Status.HEALTHY, Action.NONE, "NeuronCore busy: a job error"),
    1006: ("NRT_EXEC_OOB", Status.HEALTHY, Action.NONE, "out-of-bounds access: a software error"),
    1200: ("NRT_EXEC_HW_ERR_COLLECTIVES", Status.DEGRADED, Action.NONE,
           "hang in collectives: the faulty node may be a peer"),
    1201: ("NRT_EXEC_HW_ERR_HBM_UE", Status.UNHEALTHY, Action.REPLACE, "uncorrectable HBM error"),
    1202: ("NRT_EXEC_HW_ERR_NC_UE", Status.UNHEALTHY, Action.REPLACE,
           "uncorrectable NeuronCore (SRAM) error"),
    1203: ("NRT_EXEC_HW_ERR_DMA_ABORT", Status.UNHEALTHY, Action.REPLACE, "DMA engine abort"),
    1204: ("NRT_EXEC_SW_NQ_OVERFLOW", Status.HEALTHY, Action.NONE,
           "notification queue overflow: a software error"),
    1205: ("NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", Status.UNHEALTHY, Action.REBOOT,
           "repairable uncorrectable HBM error: reload the driver or reboot"),
    1206: ("NRT_NETWORK_PROXY_FAILURE", Status.DEGRADED, Action.NONE,
           "network proxy failure (EFA or a peer)"),
}


def _sig(name: str, pattern: str, status: Status, action: Action, meaning: str) -> Signature:
    return Signature(name, re.compile(pattern), status, action, meaning)


_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY
_KNOWN_HW_ERR = r"(?:SRAM_UNCORRECTABLE_ERROR|NC_UNCORRECTABLE_ERROR|HBM_UNCORRECTABLE_ERROR|DMA_ERROR)\b"
_REPAIRABLE = r"(?:reload the neuron driver|reboot your EC2 instance)"
_NRT_NUMBER = r"\b(?i:completed with err(?:or)?|nrt[ _]status(?: code)?)\s*[:=]?\s*"  # "... with err: 5"

SIGNATURES: tuple[Signature, ...] = (
    # hardware: replace
    _sig("sram-ue", r"Uncorrectable memory error is detected", _U, Action.REPLACE,
         "uncorrectable SRAM error (NRT 1202)"),
    _sig("hbm-ue", rf"Uncorrectable HBM memory error is detected(?!.*{_REPAIRABLE})", _U, Action.REPLACE,
         "uncorrectable HBM error (NRT 1201)"),
    _sig("dma-abort", r"DMA [TR]X engine \d+ is in an abort state", _U, Action.REPLACE,
         "DMA engine abort (NRT 1203)"),
    _sig("compute-hang", r"(?:execution|inference) timeout \(\d+ ms\) on Neuron Device \d+ NC \d+"
                         r".*waiting for execution completion notification", _U, Action.REPLACE,
         "hang on compute (execution timeout)"),
    _sig("kernel-sram-ue", r"NEURON_HW_ERR=SRAM_UNCORRECTABLE_ERROR\b", _U, Action.REPLACE,
         "kernel: SRAM uncorrectable error"),
    _sig("kernel-nc-ue", r"NEURON_HW_ERR=NC_UNCORRECTABLE_ERROR\b", _U, Action.REPLACE,
         "kernel: NeuronCore uncorrectable error"),
    _sig("kernel-hbm-ue", r"NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR\b", _U, Action.REPLACE,
         "kernel: HBM uncorrectable error"),
    _sig("kernel-dma", r"NEURON_HW_ERR=DMA_ERROR\b", _U, Action.REPLACE, "kernel: DMA error"),
    _sig("kernel-hw-terminate", rf"NEURON_HW_ERR=(?!{_KNOWN_HW_ERR})\w+.*action=TERMINATE_INSTANCE", _U,
         Action.REPLACE, "kernel: Neuron hardware error, action=TERMINATE_INSTANCE"),
    # soft hardware / driver state: reboot
    _sig("hbm-ue-repairable", rf"Uncorrectable HBM memory error is detected.*{_REPAIRABLE}", _U,
         Action.REBOOT, "repairable uncorrectable HBM error (NRT 1205): reload the driver or reboot"),
    _sig("kernel-hw-other", rf"NEURON_HW_ERR=(?!{_KNOWN_HW_ERR})\w+(?!.*action=TERMINATE_INSTANCE)", _U,
         Action.REBOOT, "kernel: unknown Neuron hardware error"),
    _sig("driver-not-running", r"Neuron DKMS Driver is not running", _U, Action.REBOOT,
         "the Neuron driver is not running"),
    _sig("driver-missing", r"Unable to determine Neuron Driver version", _U, Action.REBOOT,
         "the Neuron driver is missing"),
    # the node may be involved, its own log cannot tell: never a drain
    _sig("collectives-hang", r"missing collectives status|suspected hang in collectives", _D, Action.NONE,
         "hang in collectives (NRT 1200): the faulty node may be a peer"),
    _sig("stuck-after-collectives", r"is stuck after all collectives operation", _D, Action.NONE,
         "execution stuck after its collectives: a hang here or on a peer"),
    _sig("peer-closed", r"connection closed by remote peer", _D, Action.NONE,
         "another rank died: restart from the checkpoint, look at the peer"),
    _sig("bootstrap", r"failed neuronBootstrapRecv", _D, Action.NONE, "bootstrap with the peers failed"),
    _sig("efa-init", r"OFI plugin initNet\(\) failed", _D, Action.NONE,
         "EFA not initialised (configuration, or an EFA fault: check the EFA count)"),
    _sig("efa-channels", r"has less channels than this replica group", _D, Action.NONE,
         "too few EFA channels (configuration, or missing EFA devices)"),
    _sig("cores-busy", r"NeuronCore\(s\) not available", _D, Action.NONE,
         "NeuronCores held by another process (a leftover run?)"),
    # recognised, not the node's fault
    _sig("rx-timeout", r"Timeout waiting for RX", _H, Action.NONE,
         "transient: a peer may still be compiling"),
    _sig("incoming-timeout", r"Timeout waiting for incoming connection", _H, Action.NONE,
         "transient: a peer may still be compiling"),
    _sig("connect-retry", r"Connect to \S+ failed - retrying", _H, Action.NONE,
         "transient: a peer is not listening yet"),
    _sig("efa-dereg", r"Failed to process command DEREG_MR", _H, Action.NONE, "benign after a process exit"),
    _sig("libnccom", r"Error opening libnccom\.so", _H, Action.NONE,
         "configuration: libnccom.so not on LD_LIBRARY_PATH"),
    _sig("fork-safe", r"requires setting FI_EFA_FORK_SAFE=1", _H, Action.NONE,
         "configuration: set FI_EFA_FORK_SAFE=1"),
    _sig("open-files", r"Too many open files", _H, Action.NONE, "configuration: raise the open-files ulimit"),
    _sig("collective-layout", r"failed \(\d+\) to init a collective algorithm", _H, Action.NONE,
         "configuration: the replica groups (TP/DP layout) do not fit"),
    _sig("dge-timeout", r"potentially caused by DGE notifications enabled", _H, Action.NONE,
         "configuration: disable DGE notifications (NEURON_RT_ENABLE_DGE_NOTIFICATIONS=0)"),
    # NRT status codes, by name or number
    *(_sig(f"nrt-{code}", rf"\b{name}\b|{_NRT_NUMBER}\(?{code}\b", status, action,
           f"{name} ({code}): {meaning}")
      for code, (name, status, action, meaning) in NRT_CODES.items()),
)

_PREFIXES = (
    re.compile(r"^\d{4}-\w{3}-\d{2} [\d:.]+\s+\d+:\d+\s+"),  # runtime log: time, pid:tid
    re.compile(r"^(?:ERROR|WARN\w*|INFO|DEBUG)\s+[A-Z]+:\S+\s+"),  # then level, MOD:function
    re.compile(r"^\[\s*[\d.]+\]\s*"),  # dmesg timestamp
)


def classify_log(text: str) -> list[Finding]:
    """Neuron runtime and kernel error signatures in a log, each mapped through ``SIGNATURES``:
    one finding per signature seen (the first line quoted, the count when more)."""
    if "\x00" in text:
        return [probe_failed("neuron-log", "the log holds binary data (NUL bytes), not text")]
    seen: dict[str, tuple[Signature, str, int]] = {}
    lines = text.splitlines()
    for line in lines:
        for sig in SIGNATURES:
            if sig.pattern.search(line):
                first, count = seen[sig.name][1:] if sig.name in seen else (line, 0)
                seen[sig.name] = (sig, first, count + 1)
    if not seen:
        return [Finding(probe="neuron-log", status=Status.HEALTHY,
                        evidence=f"no known error signature in {len(lines)} lines")]
    findings = []
    for sig, line, count in seen.values():
        times = f" (x{count})" if count > 1 else ""
        findings.append(Finding(probe="neuron-log", status=sig.status, action=sig.action,
                                evidence=f"{sig.meaning}{times}: {_message(line)}"))
    return findings


def _message(line: str) -> str:
    text = line.strip()
    for prefix in _PREFIXES:
        text = prefix.sub("", text, count=1)
    return excerpt(text)
