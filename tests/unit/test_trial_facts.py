"""What a failed process is called, from facts: exception types, exit statuses, fault reports;
and its output kept to a bounded size."""

import subprocess
import sys

import pytest
import torch

from tunekit.trials.exits import describe_exit, fault_location, is_oom, signal_name
from tunekit.trials.output import HEAD_BYTES, TAIL_BYTES, CappedLog, read_tail


def test_out_of_memory_is_an_exception_type_not_words_in_a_message():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError())
    assert is_oom(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    )
    # A workload's own error that mentions memory is its error, not an allocation failure.
    assert not is_oom(ValueError("cache is out of memory budget"))
    assert not is_oom(
        RuntimeError("retry: out of memory avoided (OutOfMemoryError caught upstream)")
    )


def test_exit_statuses_are_named():
    assert signal_name(-11) == "SIGSEGV" and signal_name(1) is None and signal_name(None) is None
    assert describe_exit(-11) == "died of SIGSEGV (segmentation fault)"
    assert describe_exit(-9).startswith("died of SIGKILL (killed: out of memory")
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(0) == "exited with code 0"


def test_a_segfaulting_process_says_where_it_died(tmp_path):
    report = tmp_path / "fault.txt"
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tunekit.trials.exits import enable_fault_report\n"
        "enable_fault_report(Path(sys.argv[1]))\n"
        "def crash_here():\n"
        "    import ctypes\n"
        "    ctypes.string_at(0)\n"
        "crash_here()\n"
    )
    script = tmp_path / "crashes.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script), str(report)], capture_output=True, timeout=120
    )
    assert signal_name(proc.returncode) == "SIGSEGV"
    # The innermost frame outside Python's own library (ctypes), not ctypes.string_at itself.
    assert fault_location(report) == "crashes.py:7 in crash_here"
    assert fault_location(tmp_path / "none.txt") is None


def test_a_capped_log_keeps_head_and_tail_and_bounded_memory(tmp_path):
    log = CappedLog(tmp_path / "agent0.log")
    log.write(b"first line\n")
    chunk = b"x" * 1023 + b"\n"
    written = len(b"first line\n")
    for _ in range(16 * 1024):  # 16 MiB in 1 KiB writes
        log.write(chunk)
        written += len(chunk)
        assert log.tail_size <= TAIL_BYTES + len(chunk)  # memory: the tail, never the whole stream
    log.write(b"last line\n")
    written += len(b"last line\n")
    record = log.close()
    text = (tmp_path / "agent0.log").read_bytes()
    assert text.startswith(b"first line\n") and text.endswith(b"last line\n")
    assert len(text) <= HEAD_BYTES + TAIL_BYTES + 200
    assert record.bytes == written
    assert record.kept_bytes == HEAD_BYTES + TAIL_BYTES
    assert record.dropped_bytes == written - HEAD_BYTES - TAIL_BYTES
    assert b"of output dropped here" in text
    assert "dropped 14.9 MiB" in record.describe()
    assert read_tail(tmp_path / "agent0.log", 10) == "last line\n"


@pytest.mark.parametrize("size", [0, 100, HEAD_BYTES + 5])
def test_a_short_output_is_kept_whole(tmp_path, size):
    data = bytes(i % 251 for i in range(size))
    log = CappedLog(tmp_path / "out.log")
    for i in range(0, size, 777):
        log.write(data[i : i + 777])
    record = log.close()
    assert (tmp_path / "out.log").read_bytes() == data
    assert (record.bytes, record.kept_bytes, record.dropped_bytes) == (size, size, 0)


def test_the_workload_tunekit_does_not_run_carries_its_facts_and_training_features():
    """tunekit's own process sees the observed workload as a stand-in: global_batch (micro-batches
    included) and the features must be the real workload's; its code must not run here."""
    import json

    from support import WORKLOADS

    from tunekit.observe.workload_process import stand_in_workload, workload_facts
    from tunekit.workload import load_workload

    real = load_workload(f"{WORKLOADS}:featured")
    stand_in = stand_in_workload(
        json.loads(json.dumps(workload_facts(real)))
    )  # as it crosses the pipe
    for name in (
        "name",
        "batch_size",
        "lr",
        "accumulation",
        "clip_grad_norm",
        "precision",
        "grad_scaler",
    ):
        assert getattr(stand_in, name) == getattr(real, name), name
    assert stand_in.accumulation == 3 and stand_in.scheduler is not None
    with pytest.raises(RuntimeError, match="runs in its own process"):
        stand_in.model()
