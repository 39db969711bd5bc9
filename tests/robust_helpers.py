"""Shared fixtures of the robustness tests: a tiny valid trace, spec, grid and coefficient
file, and the CLI contract (exit 2 with one short `error:` line, no traceback)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from blis_jax.cli import main
from blis_jax.workload.tracev2 import REQUIRED_COLUMNS

MAX_ERROR_CHARS = 200 + len("blis-jax calibrate: error: ")

TRACE_HEADER = "trace_version: 3\ntime_unit: microseconds\nmode: generated\nwarm_up_requests: 0\n"
SPEC = ("version: '2'\nseed: 7\ncategory: language\naggregate_rate: 5\nnum_requests: 4\nclients:\n"
        "- id: c\n  rate_fraction: 1\n  arrival: {process: constant}\n"
        "  input_distribution: {type: constant, params: {value: 32}}\n"
        "  output_distribution: {type: constant, params: {value: 4}}\n")
COEFFS = ("alpha: [15563.2, 777.35, 45.91]\n"
          "beta: [0.152128, 0.0, 1.36252915, 0.752037, 32.0955, 4.41684, 126.0248, 481.861, 0.0, "
          "1.94710771, 0.752037]\n")
GRID = "base:\n  num-requests: 4\naxes:\n  rate: [1, 2]\n"


def trace_row(**cells) -> dict:
    row = {name: "" for name in REQUIRED_COLUMNS}
    row.update(request_id="0", client_id="c", round_index="0", prefix_length="0", streaming="false",
               input_tokens="32", output_tokens="4", text_tokens="0", image_tokens="0", audio_tokens="0",
               video_tokens="0", reason_ratio="0", deadline_us="0", server_input_tokens="0",
               arrival_time_us="1000", send_time_us="1000", num_chunks="0", status="ok")
    row.update({k: str(v) for k, v in cells.items()})
    return row


def trace_csv(rows: list[dict]) -> str:
    lines = [",".join(REQUIRED_COLUMNS)]
    lines += [",".join(r[name] for name in REQUIRED_COLUMNS) for r in rows]
    return "\n".join(lines) + "\n"


def write_trace_files(tmp: Path, rows: list[dict] | None = None, name: str = "t") -> tuple[Path, Path]:
    rows = rows if rows is not None else [trace_row(request_id=i, arrival_time_us=1000 * (i + 1),
                                                    send_time_us=1000 * (i + 1)) for i in range(3)]
    header, data = tmp / f"{name}.yaml", tmp / f"{name}.csv"
    header.write_text(TRACE_HEADER)
    data.write_text(trace_csv(rows))
    return header, data


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def assert_one_error_line(rc: int, err: str, *words: str) -> str:
    """The contract for bad input: exit 2, one `error:` line of bounded length, no traceback;
    returns the line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 1, err[-2000:]
    # The length the message itself takes: the directories of the test's temporary paths removed.
    text = re.sub(r"(/[^\s/'\"]+)+/", "", errors[0])
    assert len(text) <= MAX_ERROR_CHARS, (len(text), errors[0][:500])
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def snapshot(*paths: Path) -> dict[Path, bytes]:
    return {Path(p): Path(p).read_bytes() for p in paths}


def assert_unchanged(before: dict[Path, bytes]) -> None:
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} was modified"
