"""Pure parts of the notebook engines: device plan, engine env, argv, error rendering."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hora.engines.errors import (
    CellFailedError,
    CudaInitializedError,
    NotEnoughGpusError,
    RankDiedError,
    RankError,
    exit_status,
)
from hora.engines.execute import pick_thread
from hora.engines.plan import (
    ClusterOptions,
    GpuInfo,
    check_cuda_free,
    controller_argv,
    engine_argv,
    engine_env,
    plan_devices,
)
from hora.errors import SpecError
from hora.inventory import parse_gpu_apps

GPUS = [GpuInfo("0"), GpuInfo("1"), GpuInfo("2", busy_pids=(4242,)), GpuInfo("3")]


@pytest.mark.parametrize(
    ("n", "gpus", "visible", "expected"),
    [
        (None, None, [], [None, None]),
        (3, None, [], [None, None, None]),
        (None, None, GPUS, ["0", "1", "3"]),
        (2, None, GPUS, ["0", "1"]),
        (None, ("3", "0"), GPUS, ["3", "0"]),
    ],
)
def test_plan_devices(n, gpus, visible, expected):
    assert plan_devices(n, gpus, visible) == expected


@pytest.mark.parametrize(
    ("n", "gpus", "message"),
    [
        (
            4,
            None,
            "asked for 4 GPUs, 4 visible (0, 1, 2, 3), 3 free (0, 1, 3): "
            "pass -n 3 (GPU 2 used by pid 4242)",
        ),
        (None, ("2",), "GPU 2 used by pid 4242"),
        (None, ("7",), "GPU 7 not visible"),
        (None, ("0", "0"), "listed twice"),
    ],
)
def test_plan_devices_refuses_with_what_to_do(n, gpus, message):
    with pytest.raises(NotEnoughGpusError) as exc:
        plan_devices(n, gpus, GPUS)
    assert message in str(exc.value)


def test_all_gpus_busy_says_free_one():
    with pytest.raises(NotEnoughGpusError, match="free a GPU"):
        plan_devices(None, None, [GpuInfo("0", busy_pids=(1,))])


def test_engine_env_shows_every_engine_all_gpus_without_touching_base():
    base = {"PATH": "/bin", "RANK": "9", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "JPY_PARENT_PID": "1"}
    env = engine_env(
        base, rank=1, size=2, device="3", master_port=4321, backend="nccl", timeout_s=30,
        gpus=["2", "3"],
    )  # fmt: skip
    assert base["RANK"] == "9" and base["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    # all the engines' GPUs (NCCL's CUDA IPC needs them shared); it pins cuda:LOCAL_RANK = "3"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["HORA_GPU"] == "3"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == (
        "1", "2", "1", "2",
    )  # fmt: skip
    assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("0", "1")
    assert env["MASTER_PORT"] == "4321" and env["HORA_BACKEND"] == "nccl"
    assert env["HORA_TIMEOUT"] == "30" and "JPY_PARENT_PID" not in env
    assert env["PATH"] == "/bin"


def test_engine_env_on_cpu_keeps_host_local_ranks_and_one_thread():
    env = engine_env({}, rank=1, size=2, device=None, master_port=1, backend="gloo", timeout_s=60)
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert (env["LOCAL_RANK"], env["LOCAL_SIZE"], env["OMP_NUM_THREADS"]) == ("1", "2", "1")
    assert (
        engine_env(
            {"OMP_NUM_THREADS": "4"},
            rank=0,
            size=1,
            device=None,
            master_port=1,
            backend="gloo",
            timeout_s=1,
        )["OMP_NUM_THREADS"]
        == "4"
    )


def test_argv_are_lists_with_hostile_paths_kept_whole():
    odd = Path("/tmp/a b/$(rm -rf)/'q'")
    ctl = controller_argv(odd)
    eng = engine_argv(odd, odd / "stack 0.txt")
    assert ctl[:4] == [sys.executable, "-m", "hora.engines._child", "controller"]
    assert f"--profile-dir={odd}" in ctl and f"--profile-dir={odd}" in eng
    assert f"--stack-file={odd / 'stack 0.txt'}" in eng
    assert "--IPEngine.enable_nanny=False" in eng


def test_parse_gpu_apps_respects_cuda_visible_devices():
    gpus = "0, GPU-aaa\n1, GPU-bbb\n2, GPU-ccc\n"
    apps = "GPU-bbb, 77\nGPU-bbb, 78\n"
    assert parse_gpu_apps(gpus, apps, None) == [
        GpuInfo("0", index=0),
        GpuInfo("1", (77, 78), index=1),
        GpuInfo("2", index=2),
    ]
    # the lease of a GPU named by its UUID is still its index's
    chosen = parse_gpu_apps(gpus, apps, "2,GPU-bbb")
    assert chosen == [GpuInfo("2", index=2), GpuInfo("GPU-bbb", (77, 78), index=1)]
    assert [g.lease for g in chosen] == ["gpu2", "gpu1"]
    assert parse_gpu_apps(gpus, "", "") == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"backend": "mpi"}, "backend"),
        ({"timeout_s": 0}, "timeout"),
        ({"n": 2, "gpus": ("0",)}, "gpus"),
    ],
)
def test_options_are_validated_naming_the_field(kwargs, field):
    with pytest.raises(SpecError) as exc:
        ClusterOptions(**kwargs)
    assert exc.value.field == field


def test_cuda_check_uses_the_injected_predicate():
    check_cuda_free(lambda: False)
    with pytest.raises(CudaInitializedError, match="restart the kernel"):
        check_cuda_free(lambda: True)


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (0, "exit code 0"),
        (3, "exit code 3"),
        (-9, "killed by SIGKILL (out of memory?)"),
        (-11, "killed by SIGSEGV (segmentation fault)"),
        (None, "still running"),
    ],
)
def test_exit_status(code, text):
    assert exit_status(code) == text


def test_cell_failed_renders_first_whole_and_counts_the_rest():
    errs = [RankError(r, "ValueError", "bad", [f"tb of {r}"]) for r in (3, 1, 2)]
    lines = CellFailedError(errs)._render_traceback_()
    assert lines == [
        "[rank 1] ValueError: bad",
        "tb of 1",
        "also failed on ranks 2, 3 (same error)",
    ]


def test_cell_failed_summarises_different_errors():
    err = CellFailedError([RankError(0, "KeyError", "'a'"), RankError(1, "OSError", "disk")])
    assert err.others_line == "also failed on rank 1 (different errors: 1 (OSError: disk))"
    assert err.rank == 0 and err.others == [1]


def test_rank_died_names_rank_status_and_recovery():
    err = RankDiedError({1: 3}, {1: "boom"})
    assert str(err).startswith("rank 1 died (exit code 3)")
    assert "%dist_restart" in str(err)
    assert "boom" in "\n".join(err._render_traceback_())


def test_rank_died_names_ranks_left_running():
    err = RankDiedError({2: -9}, {}, [RankError(1, "RankFailedError", "peer lost")], running=[3, 0])
    lines = err._render_traceback_()
    assert lines[0].startswith("RankDiedError: rank 2 died (killed by SIGKILL (out of memory?))")
    assert "other ranks then failed: 1 (first: RankFailedError: peer lost)" in lines
    assert lines[-1].startswith("ranks 0, 3 still running the cell")
    assert lines[-1].endswith("%dist_restart stops them")
    assert err.running == [0, 3]


def test_log_tail_prefers_the_crash_dump_and_drops_startup_noise(tmp_path):
    from hora.engines.execute import log_tail

    log = tmp_path / "engine1.log"
    log.write_text(
        "2026 [IPEngine] WARNING | Not using CurveZMQ security\n"
        "2026 [IPEngine.1] WARNING | debugpy_stream undefined, debugging will not be enabled\n"
        "user wrote this\n"
    )
    assert log_tail(log) == "user wrote this"
    with log.open("a") as f:
        f.write(
            "Fatal Python error: Segmentation fault\n\n"
            "Current thread 0x0000000000000010 (most recent call first):\n"
            '  File "cell.py", line 2 in crash\n'
        )
    assert log_tail(log, main_thread=0x10) == (
        'Fatal Python error: Segmentation fault\n  File "cell.py", line 2 in crash'
    )
    assert log_tail(tmp_path / "missing.log") == ""


def test_pick_thread_keeps_main_thread_above_ipython():
    dump = (
        "Thread 0x00000000000000aa (most recent call first):\n"
        '  File "x.py", line 1 in other\n\n'
        "Current thread 0x00000000000000bb (most recent call first):\n"
        '  File "cell.py", line 3 in stuck\n'
        '  File "/site/IPython/core/interactiveshell.py", line 9 in run_code\n'
        '  File "/site/ipykernel/kernelbase.py", line 1 in dispatch\n'
    )
    assert pick_thread(dump, 0xBB) == '  File "cell.py", line 3 in stuck'
    assert pick_thread(dump, 0xAA) == '  File "x.py", line 1 in other'
    assert pick_thread(dump, 0xCC) == dump.strip()


def test_replies_become_rank_errors():
    from hora.engines.execute import _to_rank_error, in_collective
    from ipyparallel.error import EngineError, RemoteError

    assert _to_rank_error(0, RemoteError("ValueError", "x", "l1\nl2")) == RankError(
        0, "ValueError", "x", ["l1", "l2"]
    )
    assert _to_rank_error(1, EngineError("gone")) == RankError(1, "EngineError", "gone")
    assert _to_rank_error(0, {"status": "ok"}) is None
    assert in_collective('  File "/site/torch/distributed/distributed_c10d.py", line 1 in wait')
    assert not in_collective('  File "cell.py", line 3 in train')


def test_display_sink_prefixes_whole_lines_of_concurrent_ranks(capsys):
    from hora.magics import DisplaySink

    sink = DisplaySink(prefix=True)
    sink.stream(0, "stdout", "step ")
    sink.stream(1, "stdout", "step ")  # two partial lines: neither is written yet
    assert capsys.readouterr().out == ""
    sink.stream(0, "stdout", "0\n\nwin\r\n")
    sink.stream(1, "stderr", "\r 10%\r 20%")  # a progress bar redrawn with \r
    sink.stream(0, "stdout", "no newline")
    sink.flush()
    out, err = capsys.readouterr()
    assert out == (
        "[rank 0] step 0\n[rank 0] \n[rank 0] win\r\n[rank 0] no newline\n[rank 1] step \n"
    )
    assert err == "\r[rank 1]  10%\r[rank 1]  20%\n"


def test_display_sink_without_prefix_passes_text_through(capsys):
    from hora.magics import DisplaySink

    sink = DisplaySink(prefix=False)
    sink.stream(0, "stdout", "par")
    sink.stream(0, "stdout", "tial")
    sink.flush()
    assert capsys.readouterr().out == "partial"
