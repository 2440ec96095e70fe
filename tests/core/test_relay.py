"""The output relay on real pipes: pieces of lines, redraws, and the order in which ranks ended
(the launches that use it are tested in test_launch.py and test_torchrun_habits.py)."""

from __future__ import annotations

import io
import math
import os
import time

from distrun._launch.relay import RankOutput, Relay


def _piped(relay: Relay, rank: RankOutput, out: io.StringIO, err: io.StringIO):
    """Two real pipes into ``relay`` for ``rank``: their write ends."""
    ends = []
    threads = []
    for dst in (out, err):
        r, w = os.pipe()
        threads.append(relay.pipe(rank, os.fdopen(r, "rb", buffering=0), dst))
        ends.append(w)
    return ends, threads


def test_the_rank_that_failed_first_is_known_after_both_ended():
    """Two ranks whose exits one poll sees together: the relay knows which failed first (the
    launcher names that one, not the rank that lost its peer): by its streams' end, or by its
    traceback when it printed one before its exit handlers finished."""
    relay = Relay()
    out, err = io.StringIO(), io.StringIO()
    first, second = RankOutput(1), RankOutput(0)
    ends1, threads1 = _piped(relay, first, out, err)
    ends0, threads0 = _piped(relay, second, out, err)
    os.write(ends1[1], b"the cause\n")
    for fd in ends1:
        os.close(fd)
    for t in threads1:
        t.join(5)
    assert math.isinf(relay.failed_at(0))  # still open
    time.sleep(0.01)
    os.write(ends0[1], b"RuntimeError: Connection closed by peer\n")
    for fd in ends0:
        os.close(fd)
    for t in threads0:
        t.join(5)
    assert relay.failed_at(1) < relay.failed_at(0) < math.inf
    # rank 3 prints its traceback, rank 2 (its peer) fails after it, rank 3's streams close last
    late, victim = RankOutput(3), RankOutput(2)
    ends3, threads3 = _piped(relay, late, out, err)
    ends2, threads2 = _piped(relay, victim, out, err)
    os.write(ends3[1], b"Traceback (most recent call last):\n  File \"x.py\"\nValueError: x\n")
    time.sleep(0.05)
    os.write(ends2[1], b"RuntimeError: Connection closed by peer\n")
    for fd in ends2:
        os.close(fd)
    for t in threads2:
        t.join(5)
    time.sleep(0.01)
    for fd in ends3:
        os.close(fd)
    for t in threads3:
        t.join(5)
    assert relay.failed_at(3) < relay.failed_at(2) < math.inf


def test_redraws_pass_through_and_whole_lines_stay_whole():
    relay = Relay(tee=True)
    out, err = io.StringIO(), io.StringIO()
    rank = RankOutput(0)
    relay.emit(rank, "\r0/3", err)
    assert err.getvalue() == "[rank0]: \r[rank0]: 0/3"  # shown as it came
    relay.emit(rank, "\r1/3\r2/3", err)
    relay.emit(rank, "\n", err)
    assert err.getvalue() == "[rank0]: \r[rank0]: 0/3\r[rank0]: 1/3\r[rank0]: 2/3\n"
    assert list(rank.tail) == ["2/3"]  # what the terminal shows of that line
    relay.emit(rank, "a line ", out)  # print()'s pieces: held until the line is whole
    assert out.getvalue() == ""
    relay.emit(rank, "in pieces\n", out)
    assert out.getvalue() == "[rank0]: a line in pieces\n"


def test_the_log_file_gets_each_streams_lines_whole(tmp_path):
    """A rank's stdout and stderr go to one log file, read by two threads: a line written in
    pieces (unbuffered Python writes a print's text and its newline apart) is not cut by the
    other stream's line, a last line without its newline is kept at the end, and a line that
    never ends is logged as it comes rather than held without bound."""
    relay = Relay()
    out, err = io.StringIO(), io.StringIO()
    rank = RankOutput(1, log=open(tmp_path / "rank1.log", "a"))  # noqa: SIM115
    relay.emit(rank, "warn 1", err)
    relay.emit(rank, "hello from 1\n", out)
    relay.emit(rank, "\n", err)
    relay.emit(rank, "\rstep 1\rstep 2", err)
    relay.emit(rank, "no newline", out)
    relay.flush(rank, out)
    relay.flush(rank, err)
    assert (tmp_path / "rank1.log").read_bytes() == \
        b"hello from 1\nwarn 1\n\rstep 1\rno newlinestep 2"
    big = "x" * (1 << 17)
    relay.emit(rank, big, out)
    assert (tmp_path / "rank1.log").read_text().endswith(big)  # not held back
    relay.emit(rank, "y\n", out)
    relay.flush(rank, out)
    rank.log.close()
    assert (tmp_path / "rank1.log").read_text().endswith(big + "y\n")
    assert out.getvalue().endswith(big + "y\n")
