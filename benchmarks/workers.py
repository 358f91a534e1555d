"""The subprocess benchmarks' machinery (bench_linear_ce.py, bench_attention.py): each variant at each point in a
fresh worker process, watched for memory and time, checked against eager's result; their flags, table and plot."""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from smx_app.argtypes import positive_int
from smx_app.demo.memory import PeakMemory, rss_bytes

import common
from common import GB, MB, NOISY, fmt_num

TIMEOUT = 3600  # seconds before a worker is killed


def meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def mem_available() -> int | None:
    """Bytes available: /proc/meminfo's MemAvailable, or less under a cgroup v2 memory limit."""
    vals = [meminfo("MemAvailable")]
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            vals.append(None if limit == "max" else int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return min([v for v in vals if v is not None], default=None)


def say(msg: str) -> None:
    """A worker's progress line, with its point and variant."""
    print(f"  [{os.environ.get('SMX_BENCH_WORKER', '')}] {msg}", flush=True)


class Unavailable(RuntimeError):
    """A variant whose package is missing."""


def run_worker(spec_json: str, body: Callable[[dict, dict], None]) -> int:
    """A worker: ``body(spec, out)`` (an error it raises recorded), ``out`` written where the parent reads it."""
    spec, out = json.loads(spec_json), {"status": "error"}
    try:
        body(spec, out)
    except Unavailable as e:
        out.update(status="unavailable", error=str(e))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        traceback.print_exc()
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    with open(spec["out"], "w") as f:
        json.dump(out, f, default=str)
    return 0


def timed_steps(step: Callable[[], Any], rounds: int, out: dict, reset: Callable[[], None]) -> Any:
    """A warm-up step, then ``rounds`` steps after ``reset()`` each: wall and CPU seconds, peak RSS above the
    pre-step RSS and ``others`` (cores other processes used) into ``out``; -> the last step's result."""
    t0 = time.perf_counter()
    res = step()
    out.update(warmup_s=time.perf_counter() - t0, step_s=[], step_cpu_s=[], peak_bytes=[])
    say(f"warm-up {out['warmup_s']:.1f} s")
    with common.LoadMeter() as load:  # not the warm-up: its compile workers are other processes
        for r in range(rounds):
            res = None
            reset()
            with PeakMemory("cpu") as m:
                c0, t0 = time.process_time(), time.perf_counter()
                res = step()
                t1, c1 = time.perf_counter(), time.process_time()
            for k, v in (("step_s", t1 - t0), ("step_cpu_s", c1 - c0), ("peak_bytes", m.peak_bytes)):
                out[k].append(v)
            out["mem_method"] = m.method
            say(f"round {r + 1}/{rounds}: {t1 - t0:.3f} s, peak {m.peak_bytes / MB:.1f} MB above the pre-step RSS")
    if rounds:
        out["others"] = load.others
    return res


def conclude(spec: dict, out: dict, got: dict[str, Any], tol: dict[str, float]) -> None:
    """A worker's end: the smx reports, and ``got`` ({name: tensor or list}) checked finite and within ``tol`` of
    the reference (``<name>_rel``: max |got - ref| / max |ref|); eager and "reference" save theirs as it."""
    import torch

    if spec["variant"] == "smx":
        out["smx_report"] = common.smx_report_summary()
    flat = {k: v if isinstance(v, list) else [v] for k, v in got.items()}
    chk: dict[str, Any] = {}
    if any(t is None for ts in flat.values() for t in ts):
        chk["why"] = "a gradient is missing"
    elif not all(bool(torch.isfinite(t).all()) for ts in flat.values() for t in ts):
        chk["why"] = "not finite"
    elif spec["variant"] in ("eager", "reference"):
        torch.save(dict(flat, by=spec.get("by", "eager")), spec["ref"])
        chk["against"] = "itself (reference)"
    elif not os.path.exists(spec["ref"]):
        chk["why"] = "no reference to compare with"
    else:
        ref = torch.load(spec["ref"], weights_only=True)
        chk["against"] = ref["by"]
        for k, ts in flat.items():
            chk[k + "_rel"] = max(float((t - r).abs().max()) / max(float(r.abs().max()), 1e-30)
                                  for t, r in zip(ts, ref[k]))
        bad = [f"{k} {chk[k + '_rel']:.1e} > {tol[k]:.0e}" for k in flat if chk[k + "_rel"] > tol[k]]
        if bad:
            chk["why"] = "outside tolerance: " + ", ".join(bad)
    out.update(check=chk, status="FAILED" if "why" in chk else "ok")


def launch(spec: dict, limit: int | None, script: str, label: str) -> dict:
    """``script --_worker SPEC`` in a fresh process -> its result; killed when its RSS passes ``limit``, the machine
    runs low on memory, or it runs past :data:`TIMEOUT`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", SMX_BENCH_WORKER=label)
    if spec["mmap_threshold"] and "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # RSS then follows the live buffers
        env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
    spec = dict(spec, out=f"{spec['ref']}.{time.monotonic_ns()}.json")
    proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--_worker", json.dumps(spec)], env=env)
    killed = None
    with common.LoadMeter() as load:
        while proc.poll() is None and not killed:
            rss, avail = rss_bytes("VmRSS", str(proc.pid)) or 0, meminfo("MemAvailable")
            if limit is not None and rss > limit:
                killed = f"killed: its RSS reached {rss / GB:.1f} GB, over the limit {limit / GB:.1f} GB (--mem-limit)"
            elif avail is not None and avail < 0.5 * GB:
                killed = f"killed: the machine ran low on memory ({avail / GB:.2f} GB available; RSS {rss / GB:.1f} GB)"
            elif time.monotonic() - load.t0 > TIMEOUT:
                killed = f"killed: ran over {TIMEOUT} s"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    if killed or not os.path.exists(spec["out"]):
        res = {"status": "killed" if killed else "error",
               "error": killed or f"worker exited with status {proc.returncode} and no result"}
    else:
        with open(spec["out"]) as f:
            res = json.load(f)
    return dict({"others": load.others}, **res, wall_s=time.monotonic() - load.t0)


def least_disturbed(run: Callable[[], dict], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """``run()`` (a worker), again up to --retry-noisy times while other processes used > NOISY cores meanwhile;
    -> the least disturbed finished try."""
    tries: list[dict] = []
    while True:
        tries.append(run())
        load, status = tries[-1]["others"] or 0, tries[-1]["status"]
        if load <= NOISY or status not in ("ok", "FAILED") or len(tries) > args.retry_noisy:
            break
        log(f"other processes took {load:.2f} cores: running it again (--retry-noisy)")
    return min(tries, key=lambda r: (r["status"] not in ("ok", "FAILED"), r["others"] or 0))


def summary(r: dict) -> dict:
    """A finished worker's median step and CPU seconds, warm-up, peak bytes (``transient_bytes``: less grads)."""
    if not r.get("step_s"):
        return {}
    s = {"step_s": statistics.median(r["step_s"]), "cpu_s": statistics.median(r["step_cpu_s"]),
         "warmup_s": r["warmup_s"], "peak_bytes": max(r["peak_bytes"])}
    return dict(s, transient_bytes=s["peak_bytes"] - r["grads_bytes"]) if "grads_bytes" in r else s


def parser(doc: str, variants: tuple[str, ...], grad_rtol: float, quick: str) -> argparse.ArgumentParser:
    """A subprocess benchmark's parser (description and epilog: ``doc``) with the flags both take."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=lambda s: sorted(common.choice_list(variants)(s), key=lambda v: v != "eager"),
                   default=list(variants), help=f"comma-separated subset of {','.join(variants)} (default all; eager "
                                                "runs first: it saves the reference)")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--rounds", type=positive_int, help="timed steps per variant after the warm-up, median "
                   "reported (default: linear CE 2, attention 3 up to 2048 tokens else 2; --quick 1)")
    p.add_argument("--threads", type=positive_int, default=common.cores(),
                   help="torch threads (default: all cores)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="max |loss - eager| / |eager| (default %(default)s)")
    p.add_argument("--grad-rtol", type=float, default=grad_rtol,
                   help="max |grad - eager| / max |eager grad| (default %(default)s)")
    p.add_argument("--mem-limit", type=float, metavar="GB",
                   help="largest RSS a variant's process may reach: variants estimated above it are skipped, one "
                        "that passes it is killed (default: memory available at start minus 2 GB)")
    p.add_argument("--mmap-threshold", type=int, default=2**20, metavar="BYTES",
                   help="glibc MALLOC_MMAP_THRESHOLD_ of the workers (default 1 MiB; 0: glibc's dynamic threshold)")
    common.add_noise_flags(p)
    p.add_argument("--json", metavar="PATH", help="write every figure, the environment and the command to PATH")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--plot", metavar="PATH", help="time and peak memory (PNG/SVG/PDF; needs matplotlib)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    return p


def run(args: argparse.Namespace, script: str, packages: tuple[str, ...], settings: dict,
        points: list[tuple[dict, list[str]]], estimate: Callable[[dict], int]) -> dict:
    """Each variant of each ``(point, variants)`` in a fresh process, eager first (else an untimed "reference"
    worker saves the reference); skipped where ``estimate(spec)`` bytes do not fit; the JSON rewritten after each."""
    command, env, avail = common.command_line(), common.environment(args.threads, packages, git=True), mem_available()
    env.update(mem_total_gb=round((meminfo("MemTotal") or 0) / GB, 1), mem_available_gb=round((avail or 0) / GB, 1))
    common.print_header(command, env, "the `others` column says, per variant, whether they shared its timed steps")
    limit = int(args.mem_limit * GB) if args.mem_limit else (int(avail - 2 * GB) if avail else None)
    settings.update({k: getattr(args, k) for k in ("rounds", "threads", "loss_rtol", "grad_rtol", "mmap_threshold")},
                    mem_limit_bytes=limit, malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    print(f"settings: {settings}; one fresh process per variant; memory limit {(limit or 0) / GB:.1f} GB", flush=True)
    results, t0 = [], time.monotonic()
    result = {"command": command, "env": env, "settings": settings, "results": results}

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    def one(spec: dict, where: str) -> dict:
        log(f"[{where} {spec['variant']}] fresh process (estimated peak RSS {estimate(spec) / GB:.1f} GB)")
        return launch(spec, limit, script, f"{where} {spec['variant']}")

    with tempfile.TemporaryDirectory() as workdir:
        for n, (point, variants) in enumerate(points):
            where = " ".join(f"{k}={v}" for k, v in point.items())
            for name in variants:
                spec = dict(settings, **point, variant=name, ref=os.path.join(workdir, f"ref-{n}.pt"))
                if name != "eager" and not os.path.exists(spec["ref"]):
                    results.append(dict(one(dict(spec, variant="reference", rounds=0), where), **point,
                                        point=where, variant="reference"))
                avail, est = mem_available(), estimate(spec)
                room = min([x for x in (limit, avail and avail - GB) if x is not None], default=None)
                if room is not None and est > room:
                    res = {"status": "skipped", "error": f"needs ~{est / GB:.1f} GB, {room / GB:.1f} GB usable"}
                else:
                    res = least_disturbed(lambda: one(spec, where), args, log)
                results.append(dict(res, **point, point=where, variant=name, estimated_rss_bytes=est))
                log(f"{where} {name}: {res['status']} {res.get('error') or res.get('check', {}).get('why') or ''}")
                common.write_json(args.json, result)
    inductor = {r["point"]: summary(r) for r in results if r["variant"] == "inductor" and r["status"] == "ok"}
    for r in results:
        r["summary"], base = summary(r), inductor.get(r["point"], {})
        r["ratio_vs_inductor"] = {k: v / base[k] for k, v in r["summary"].items() if base.get(k)}
    result["wall_s"] = time.monotonic() - t0
    return result


def table(title: str, results: list[dict], point_keys: tuple[str, ...], metrics: dict[str, tuple[str, float]],
          rels: dict[str, str], markdown: bool) -> None:
    """A row per variant: the point, ``metrics`` ({header: (summary key, scale)}; "(/ind)": with the ratio to
    inductor), the differences ``rels`` ({header: check key}), the check, the others' load and a note."""
    head, rows = [*point_keys, "variant", *metrics, *rels, "check", "others", "smx report / note"], []
    for r in (r for r in results if r["variant"] != "reference"):
        s, ratio, chk, rep = r["summary"], r["ratio_vs_inductor"], r.get("check", {}), r.get("smx_report")
        cells = [str(r[k]) for k in point_keys] + [r["variant"]]
        for h, (k, scale) in metrics.items():
            x = f" ({ratio[k]:.2f}x)" if "(/ind)" in h and r["variant"] != "inductor" and k in ratio else ""
            cells.append(fmt_num(s[k] * scale) + x if k in s else "-")
        cells += [f"{chk[k]:.1e}" if k in chk else "-" for k in rels.values()]
        notes = [f"{common.sites_text(rep)} ({rep['graphs']} graph(s))" if rep else "", r.get("note", ""),
                 "" if chk.get("against") in (None, "eager", "itself (reference)") else f"against {chk['against']}",
                 chk.get("why", "") if r["status"] == "FAILED" else r.get("error", "")[:140]]
        rows.append(cells + [r["status"], fmt_num(r.get("others"), 2), "; ".join(n for n in notes if n)])
    common.print_table(title, head, rows, markdown, left=("variant", "check", "smx report / note"))


def plot(results: list[dict], path: str, title: str, x: str, metrics: dict[str, tuple[str, float]],
         label: Callable[[dict], str], by: str | None = None) -> str:
    """The "(/ind)" ``metrics`` against ``x`` (log-log), a panel each (a row of them per value of ``by``), a line
    per ``label(row)``; -> what to print."""
    plt = common.pyplot()
    if plt is None:
        return "--plot: " + common.NO_MATPLOTLIB
    done = [r for r in results if r["variant"] != "reference" and r["summary"]]
    labels, groups = list(dict.fromkeys(label(r) for r in done)), list(dict.fromkeys(r.get(by) for r in done))
    heads, xs = [h for h in metrics if "(/ind)" in h], sorted({r[x] for r in done})
    fig, axes = plt.subplots(len(groups), len(heads), figsize=(5 * len(heads), 1.5 + 4 * len(groups)), squeeze=False)
    for ax, (group, head) in zip(axes.flat, itertools.product(groups, heads)):
        (key, scale), name = metrics[head], head.replace(" (/ind)", "")
        for i, lab in enumerate(labels):
            pts = sorted((r[x], r["summary"][key] * scale) for r in done if label(r) == lab and r.get(by) == group)
            if pts:
                ax.plot(*zip(*pts), "-" if i < 10 else "--", marker="o", color=f"C{i % 10}", label=lab)
        ax.set(xscale="log", yscale="log", title=f"{group}: {name}" if group else name, xlabel=x, ylabel=name)
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.grid(alpha=0.3, which="both")
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="lower center", ncol=8, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=8)
    return common.save_figure(fig, path, rect=(0, 0.08, 1, 1))


def finish(result: dict, args: argparse.Namespace, title: str, x: str, metrics: dict[str, tuple[str, float]],
           label: Callable[[dict], str], by: str | None = None) -> int:
    """The plot (:func:`plot`), the JSON, the command, the failed rows; -> 1 when a row FAILED, raised or was killed."""
    if args.plot:
        print(plot(result["results"], args.plot, f"{result['command']}\n{title}", x, metrics, label, by))
    common.print_load_at_end(result["env"])
    common.write_json(args.json, result)
    print(f"\n$ {result['command']}   ({result['wall_s']:.0f} s)" + (f"\nwrote {args.json}" if args.json else ""))
    bad = [r for r in result["results"] if r["status"] in ("FAILED", "error", "killed")]
    for r in bad:
        print(f"{r['status']}: {r['point']} {r['variant']}: {r.get('check', {}).get('why') or r.get('error')}")
    return 1 if bad else 0
