"""One profiling session's files, merged into one timeline and summarized.

    python -m common.timeline DIR            # (re)merge the latest session in DIR and print its summary

Input, per process (`common.profiling` writes them): `<process>.phases.json` (its phases on the host's
monotonic clock, its step timings, clock facts) and `<process>.pt.trace.json.gz` (its torch.profiler trace).
Output, in the same folder: `timeline.json.gz` (Chrome trace JSON: open it in https://ui.perfetto.dev,
chrome://tracing or TensorBoard), `summary.txt` (the table printed at the end of a run) and `summary.json`
(the same figures, for tools).

The clock. Every process stamps its phases with `time.perf_counter_ns()`, CLOCK_MONOTONIC on Linux, which
all processes of a host share. torch.profiler stamps its events in Unix time (its own TSC clock converted
to CLOCK_REALTIME), written in microseconds after the trace's `baseTimeNanoseconds`; its CUDA events are
converted by Kineto onto that same clock. Each phase is also a `record_function` range in the torch
trace, so a trace's offset to the monotonic clock is measured, not assumed: the median, over its phases,
of (torch start - our start). The Unix-clock offset (`time.time_ns() - time.perf_counter_ns()`, read when
the session started and stopped) is the fallback for a trace without phases, and is recorded beside the
measured one. The timeline's `ts` are microseconds of `time.perf_counter()`, the clock of the step log.

Tracks: one pid per process (its OS pid), named frontend, scheduler, worker-tp0, ...; a worker's GPU
streams are threads of its pid ("GPU 0 stream 7"). Flow arrows named "step N" follow each step: the
scheduler sends its plan, rank 0 applies it and sends the result, the scheduler processes the result,
the frontend detokenizes its tokens.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from common.profiling import PHASES_FORMAT, session_folder, write_atomically

TIMELINE, SUMMARY, SUMMARY_JSON = "timeline.json.gz", "summary.txt", "summary.json"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # device work (cuda_sync is waiting)
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})  # host calls; `correlation` links their work
DEVICE_TID_BASE = 1 << 40  # a worker's GPU stream tracks: far from any OS thread id
# The path of a step through the processes, drawn as one flow arrow per step.
STEP_PATH = (("scheduler", "send"), ("worker-tp0", "apply plan"), ("worker-tp0", "send result"),
             ("scheduler", "process result"), ("frontend", "detokenize"))
WAIT_PHASES = frozenset({"wait"})  # a worker's host blocked on its device: counted as idle, not busy
_STEP_LABEL = re.compile(r"^(.*) \[step (\d+)\]$")


def process_order(name: str) -> tuple[int, int, str]:
    """frontend, scheduler, then workers by rank."""
    if name == "frontend":
        return (0, 0, name)
    if name == "scheduler":
        return (1, 0, name)
    rank = name.rpartition("tp")[2]
    return (2, int(rank) if rank.isdigit() else 0, name)


# ============================================================================ reading a session
def read_phase_files(folder: str, run: str | None = None, session: int | None = None) -> list[dict[str, Any]]:
    """The phases files in `folder` of run `run` and session `session` (default: the run and session of the
    most recently stopped file), in timeline order. Files of other runs, sessions or formats are skipped."""
    records = []
    for path in glob.glob(os.path.join(folder, "*.phases.json")):
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("format") == PHASES_FORMAT:
            records.append(record)
    if run is None and records:
        run = max(records, key=lambda r: r["stop_ns"])["run"]
    records = [r for r in records if r["run"] == run]
    if session is None and records:
        session = max(r["session"] for r in records)
    return sorted((r for r in records if r["session"] == session), key=lambda r: process_order(r["process"]))


def wait_for_processes(folder: str, run: str, session: int, expect: list[str], wait_s: float) -> list[dict[str, Any]]:
    """`read_phase_files`, once every process in `expect` has written its file or `wait_s` seconds passed."""
    deadline = time.monotonic() + wait_s
    while True:
        records = read_phase_files(folder, run, session)
        if set(expect) <= {r["process"] for r in records} or time.monotonic() >= deadline:
            return records
        time.sleep(0.2)


def load_trace(folder: str, record: dict[str, Any]) -> dict[str, Any] | None:
    """A process's torch trace (None if it has none or it cannot be read)."""
    if not record.get("trace"):
        return None
    try:
        with gzip.open(os.path.join(folder, record["trace"]), "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        print(f"common.timeline: cannot read {record['trace']}: {exc}", file=sys.stderr)
        return None
    return trace if isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list) else None


# ============================================================================ the clock
@dataclass(frozen=True)
class Alignment:
    """How a torch trace's `ts` maps onto the monotonic clock: perf_counter µs = ts - offset_us."""

    offset_us: float
    method: str  # "phases" (measured) or "unix clock" (fallback)
    matched: int  # phases found in the trace
    spread_us: float  # median absolute deviation of the matched phases' offsets
    unix_offset_us: float  # what the Unix-clock conversion gives, for comparison


def align(record: dict[str, Any], trace: dict[str, Any]) -> Alignment:
    """Measure the offset of `trace` to the monotonic clock from the phases it shares with `record`."""
    ours: dict[str, list[float]] = {}
    for name, step, start, _ in record["phases"]:
        ours.setdefault(f"{name} [step {step}]" if step >= 0 else name, []).append(start / 1e3)
    theirs: dict[str, list[float]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in ours:
            theirs.setdefault(e["name"], []).append(float(e["ts"]))
    diffs = sorted(t - o for label, starts in theirs.items() for t, o in zip(sorted(starts), ours[label]))
    unix_minus_monotonic = statistics.fmean(record["unix_minus_monotonic_ns"])
    unix_offset_us = (unix_minus_monotonic - float(trace.get("baseTimeNanoseconds", 0))) / 1e3
    if not diffs:
        return Alignment(unix_offset_us, "unix clock", 0, math.nan, unix_offset_us)
    offset = statistics.median(diffs)
    spread = statistics.median(abs(d - offset) for d in diffs)
    return Alignment(offset, "phases", len(diffs), spread, unix_offset_us)


# ============================================================================ the timeline
def _step_label(name: str) -> tuple[str, int | None]:
    m = _STEP_LABEL.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def process_events(index: int, record: dict[str, Any], trace: dict[str, Any] | None,
                   alignment: Alignment | None) -> list[dict[str, Any]]:
    """One process's events on the shared clock, as the track `record["pid"]` (named for the process)."""
    pid = record["pid"]
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": record["process"]}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": index}},
    ]
    threads: dict[int, str] = {pid: "main thread"}
    if trace is None or alignment is None:  # no torch trace: the phases alone
        for name, step, start, end in record["phases"]:
            out.append({"ph": "X", "cat": "phase", "name": name, "pid": pid, "tid": pid, "ts": start / 1e3,
                        "dur": (end - start) / 1e3, "args": {"step": step} if step >= 0 else {}})
    else:
        flow_base = (index + 1) << 44  # Kineto's flow ids are per trace: keep them apart
        for e in trace["traceEvents"]:
            source_pid = e.get("pid")
            if e.get("ph") == "M" or not isinstance(source_pid, int) or isinstance(source_pid, bool) or "ts" not in e:
                continue  # torch's own metadata and its "Spans"/"Traces" markers
            ev = dict(e)
            ev["ts"] = float(e["ts"]) - alignment.offset_us
            ev["pid"] = pid
            tid = e.get("tid") if isinstance(e.get("tid"), int) else 0
            if source_pid != record["pid"]:  # a device (Kineto gives each GPU its own pid) or its overhead
                device = max(source_pid, 0)
                tid = DEVICE_TID_BASE + device * 1_000_000 + (tid % 1_000_000)
                threads.setdefault(tid, f"GPU {device} stream {e.get('tid')}" if source_pid >= 0 else "overhead")
            else:
                threads.setdefault(tid, f"thread {tid}")
            ev["tid"] = tid
            if ev.get("ph") in ("s", "t", "f") and isinstance(ev.get("id"), int):
                ev["id"] = flow_base + ev["id"]
            if ev.get("cat") in ("user_annotation", "gpu_user_annotation"):
                name, step = _step_label(str(ev.get("name", "")))
                if step is not None:
                    ev["name"] = name
                    ev["args"] = {**(ev.get("args") or {}), "step": step}
            out.append(ev)
    for tid, name in threads.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": 0 if tid == pid else (1 if tid < DEVICE_TID_BASE else 2)}})
    return out


def step_flows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A flow arrow per step along `STEP_PATH`, each point in the middle of that phase."""
    by_process = {r["process"]: r for r in records}
    points: dict[int, list[tuple[float, int]]] = {}
    for process, phase in STEP_PATH:
        record = by_process.get(process)
        if record is None:
            continue
        seen: set[int] = set()
        for name, step, start, end in record["phases"]:
            if name == phase and step >= 0 and step not in seen:  # the first such phase of the step
                seen.add(step)
                points.setdefault(step, []).append(((start + end) / 2e3, record["pid"]))
    flows = []
    for step, path in sorted(points.items()):
        if len(path) < 2:
            continue
        for i, (ts, pid) in enumerate(path):
            ph = "s" if i == 0 else ("f" if i == len(path) - 1 else "t")
            flows.append({"ph": ph, "cat": "step", "name": f"step {step}", "id": (1 << 50) + step, "pid": pid,
                          "tid": pid, "ts": ts, "bp": "e"})
    return flows


# ============================================================================ the summary
def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)] if sorted_values else 0.0


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def process_summary(record: dict[str, Any], first_step: int, last_step: int) -> dict[str, Any]:
    """Busy and idle time of a process's loop, and its phases' times, from its phases (nanoseconds in, seconds
    and milliseconds out). Busy is the time inside phases, except `WAIT_PHASES`; idle is the time between
    phases (waiting on sockets) plus those. `steps` counts the session's steps (`first_step`..`last_step`)
    this process had a phase of; its phases may also hold the tail of the step before (a worker finishes
    step A-1 after it launched step A)."""
    start, stop = record["start_ns"], record["stop_ns"]
    spans = sorted((max(a, start), min(b, stop), name) for name, _, a, b in record["phases"] if b > start and a < stop)
    busy = sum(b - a for a, b, name in spans if name not in WAIT_PHASES)
    idle, cursor = sum(b - a for a, b, name in spans if name in WAIT_PHASES), start
    for a, b, _ in spans:
        idle += max(0, a - cursor)
        cursor = max(cursor, b)
    idle += max(0, stop - cursor)
    per_phase: dict[str, list[float]] = {}
    for name, _, a, b in record["phases"]:
        per_phase.setdefault(name, []).append((b - a) / 1e6)
    phases = {}
    for name, ms in per_phase.items():
        ms.sort()
        phases[name] = {"count": len(ms), "mean_ms": statistics.fmean(ms), "p99_ms": _percentile(ms, 99),
                        "max_ms": ms[-1], "total_s": sum(ms) / 1e3}
    steps = sorted({step for _, step, _, _ in record["phases"] if first_step <= step <= last_step})
    wall = stop - start
    return {"pid": record["pid"], "wall_s": wall / 1e9, "busy_s": busy / 1e9, "idle_s": idle / 1e9,
            "busy_share": busy / wall if wall else 0.0, "steps": len(steps), "complete": record["complete"],
            "dropped_phases": record.get("dropped_phases", 0), "phases": phases}


def device_summary(record: dict[str, Any], trace: dict[str, Any] | None, alignment: Alignment | None
                   ) -> dict[str, Any]:
    """A worker's device: busy share of the wall time, and the idle gaps between consecutive steps.

    Device work is every kernel, memcpy and memset in the trace. A piece of work belongs to the step whose
    phase encloses the host call that launched it (`correlation` links the two); a step's device time runs
    from its first piece's start to its last piece's end, and the gap between steps N and N+1 is from the
    end of N's last to the start of N+1's first. The step log measures the same gap with CUDA events
    (`idle_ms`); both are reported over the same steps.
    """
    out: dict[str, Any] = {"device": record["device"], "activity": False}
    if trace is None or alignment is None:
        return out
    start_us, stop_us = record["start_ns"] / 1e3, record["stop_ns"] / 1e3
    off = alignment.offset_us
    work: list[tuple[float, float, Any]] = []
    launches: list[tuple[float, Any]] = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat, args = e.get("cat"), e.get("args") or {}
        if cat in DEVICE_CATEGORIES:
            ts = float(e["ts"]) - off
            work.append((ts, ts + float(e.get("dur", 0.0)), args.get("correlation")))
        elif cat in LAUNCH_CATEGORIES and args.get("correlation") is not None:
            launches.append((float(e["ts"]) - off, args["correlation"]))
    if not work:
        return out
    wall = stop_us - start_us
    busy = _union_length([(max(a, start_us), min(b, stop_us)) for a, b, _ in work if b > start_us and a < stop_us])
    phases = sorted((a / 1e3, b / 1e3, step) for _, step, a, b in record["phases"] if step >= 0)
    starts = [p[0] for p in phases]
    step_of: dict[Any, int] = {}
    for ts, correlation in launches:
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= phases[i][1]:
            step_of[correlation] = phases[i][2]
    spans: dict[int, list[float]] = {}
    for a, b, correlation in work:
        step = step_of.get(correlation)
        if step is not None:
            span = spans.setdefault(step, [a, b])
            span[0], span[1] = min(span[0], a), max(span[1], b)
    gaps = [(max(0.0, spans[s + 1][0] - spans[s][1]) / 1e3, s) for s in sorted(spans) if s + 1 in spans]
    values = sorted(g for g, _ in gaps)
    logged = [record["steps"].get(str(s + 1), {}).get("idle_ms") for _, s in gaps]
    logged_ms = [v for v in logged if isinstance(v, (int, float))]
    out.update({
        "activity": True, "busy_s": busy / 1e6, "wall_s": wall / 1e6, "busy_share": busy / wall if wall else 0.0,
        "steps_with_device_work": len(spans), "gaps": len(gaps), "gap_total_ms": sum(values),
        "gap_mean_ms": statistics.fmean(values) if values else 0.0, "gap_p99_ms": _percentile(values, 99),
        "largest_gaps": [{"ms": g, "after_step": s, "before_step": s + 1} for g, s in sorted(gaps, reverse=True)[:5]],
        "step_log_gap_total_ms": sum(logged_ms) if logged_ms else None, "step_log_gaps": len(logged_ms),
    })
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the table printed at the end of a run."""
    cut = "" if summary["complete"] else " (cut short by the shutdown)"
    first, last = summary["first_step"], summary["last_step"]
    steps = f"steps {first}..{last}" if last >= first else f"no step (stopped before step {first} ran)"
    lines = [f"deltaserve profile, session {summary['session']}: {steps}{cut} in {summary['folder']}",
             f"  timeline: {os.path.join(summary['folder'], TIMELINE)} (open in https://ui.perfetto.dev or "
             "chrome://tracing); per process: <name>.pt.trace.json.gz, <name>.phases.json",
             "",
             f"  {'process':<12} {'wall s':>9} {'busy s':>9} {'idle s':>9} {'busy':>7} {'steps':>6}"]
    for name, p in summary["processes"].items():
        lines.append(f"  {name:<12} {p['wall_s']:9.3f} {p['busy_s']:9.3f} {p['idle_s']:9.3f} "
                     f"{100 * p['busy_share']:6.1f}% {p['steps']:6d}")
    missing = summary.get("missing") or []
    if missing:
        lines.append(f"  no files from: {', '.join(missing)}")
    for name, p in summary["processes"].items():
        lines += ["", f"  {name} phases{'':<14} {'count':>7} {'mean ms':>9} {'p99 ms':>9} {'max ms':>9} {'total s':>9}"]
        for phase, s in sorted(p["phases"].items(), key=lambda kv: -kv[1]["total_s"]):
            lines.append(f"    {phase:<25} {s['count']:7d} {s['mean_ms']:9.3f} {s['p99_ms']:9.3f} {s['max_ms']:9.3f} "
                         f"{s['total_s']:9.3f}")
        d = p.get("device_activity")
        if d is None:
            continue
        if not d["activity"]:
            lines.append(f"    device {d['device']}: no device activity in the trace (CPU work shows in the phases)")
            continue
        lines.append(f"    device {d['device']}: busy {d['busy_s']:.3f} s of {d['wall_s']:.3f} s "
                     f"({100 * d['busy_share']:.1f}%)")
        lines.append(f"    idle between consecutive steps: {d['gaps']} gaps, total {d['gap_total_ms']:.3f} ms, "
                     f"mean {d['gap_mean_ms']:.3f} ms, p99 {d['gap_p99_ms']:.3f} ms")
        if d["step_log_gap_total_ms"] is not None:
            lines.append(f"    the step log's idle_ms (CUDA events) over the same {d['step_log_gaps']} steps: "
                         f"total {d['step_log_gap_total_ms']:.3f} ms")
        if d["largest_gaps"]:
            lines.append("    largest gaps: " + "; ".join(f"{g['ms']:.3f} ms between steps {g['after_step']} and "
                                                       f"{g['before_step']}" for g in d["largest_gaps"]))
    return "\n".join(lines) + "\n"


# ============================================================================ merging
def merge(folder: str, run: str | None = None, session: int | None = None, expect: list[str] | None = None,
          wait_s: float = 0.0) -> dict[str, Any]:
    """Merge one session in `folder` (default: its latest) into `timeline.json.gz`, `summary.txt` and
    `summary.json`; returns the summary (`format_summary` prints it). Raises `FileNotFoundError` if the
    folder holds no phases file of that run and session."""
    records = read_phase_files(folder, run, session)
    if records and expect and wait_s > 0:
        records = wait_for_processes(folder, records[0]["run"], records[0]["session"], expect, wait_s)
    if not records:
        raise FileNotFoundError(f"no profiling session in {folder} (no *.phases.json"
                                f"{f' of run {run}' if run else ''}{f', session {session}' if session else ''})")
    events: list[dict[str, Any]] = []
    processes: dict[str, dict[str, Any]] = {}
    clock: dict[str, Any] = {}
    first_step = records[0]["first_step"]
    planner = next((r for r in records if r["process"] == "scheduler"), None)  # it numbers the steps
    last_step = (planner or max(records, key=lambda r: r["last_step"]))["last_step"]
    for index, record in enumerate(records):
        trace = load_trace(folder, record)
        alignment = align(record, trace) if trace is not None else None
        events += process_events(index, record, trace, alignment)
        processes[record["process"]] = summary = process_summary(record, first_step, last_step)
        if record["process"].startswith("worker"):
            summary["device_activity"] = device_summary(record, trace, alignment)
        clock[record["process"]] = None if alignment is None else {
            "method": alignment.method, "offset_us": alignment.offset_us, "matched_phases": alignment.matched,
            "spread_us": alignment.spread_us, "unix_clock_offset_us": alignment.unix_offset_us}
        del trace
    events += step_flows(records)
    summary = {
        "run": records[0]["run"], "session": records[0]["session"], "folder": folder, "first_step": first_step,
        "last_step": last_step, "complete": all(r["complete"] for r in records), "processes": processes,
        "missing": sorted(set(expect or []) - set(processes)), "clock": clock,
    }
    timeline = {"traceEvents": events, "displayTimeUnit": "ms",
                "deltaserve": {"run": summary["run"], "session": summary["session"],
                               "clock": "microseconds of time.perf_counter() (CLOCK_MONOTONIC)", "alignment": clock}}
    write_atomically(os.path.join(folder, TIMELINE), gzip.compress(json.dumps(timeline).encode(), compresslevel=1))
    del timeline, events
    write_atomically(os.path.join(folder, SUMMARY_JSON), json.dumps(summary, indent=1).encode())
    write_atomically(os.path.join(folder, SUMMARY), format_summary(summary).encode())
    return summary


def finish_run(profile_dir: str, run: str) -> list[str]:
    """At the end of run `run`: merge each of its sessions whose summary is missing or leaves out a process
    that wrote its files since (a session cut short by the shutdown); returns their summary tables."""
    folders = [profile_dir, *sorted(glob.glob(os.path.join(profile_dir, "session-*")))]
    tables = []
    for folder in folders:
        sessions = {r["session"] for r in _all_records(folder) if r["run"] == run}
        for session in sorted(sessions):
            if session_folder(profile_dir, session) != folder:
                continue
            present = {r["process"] for r in read_phase_files(folder, run, session)}
            try:
                with open(os.path.join(folder, SUMMARY_JSON), encoding="utf-8") as f:
                    done = json.load(f)
                if done.get("run") == run and done.get("session") == session and present <= set(done["processes"]):
                    continue
            except (OSError, ValueError, KeyError, TypeError):
                pass
            tables.append(format_summary(merge(folder, run, session)))
    return tables


def _all_records(folder: str) -> list[dict[str, Any]]:
    out = []
    for path in glob.glob(os.path.join(folder, "*.phases.json")):
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
            if record.get("format") == PHASES_FORMAT:
                out.append({"run": record["run"], "session": record["session"]})
        except (OSError, ValueError, AttributeError, KeyError):
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.timeline",
                                description="Merge a deltaserve profiling session into timeline.json.gz and "
                                            "summary.txt, and print the summary.")
    p.add_argument("folder", help="a profile folder (--profile-dir, or one of its session-N folders)")
    p.add_argument("--run", default=None, help="the run whose files to merge (default: the latest)")
    p.add_argument("--session", type=int, default=None, help="the session to merge (default: the latest)")
    p.add_argument("--expect", default="", help="comma-separated process names to wait for")
    p.add_argument("--wait-s", type=float, default=0.0, help="how long to wait for the expected processes' files")
    p.add_argument("--quiet", action="store_true", help="do not print the summary")
    args = p.parse_args(argv)
    try:
        summary = merge(args.folder, args.run, args.session, [n for n in args.expect.split(",") if n], args.wait_s)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(format_summary(summary), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
