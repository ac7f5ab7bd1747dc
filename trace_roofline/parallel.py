"""Many traces at once: in this process, on `jobs` local processes, or on a Dask cluster.

Design notes: docs/design.md ("trace_roofline/parallel.py").
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar, cast

import pandas as pd

from trace_roofline import memory
from trace_roofline.attribution.ranks import RankInfo, rank_info
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec
from trace_roofline.options import AnalysisOptions
from trace_roofline.pipeline import Run, analyze_trace
from trace_roofline.roofline import Analysis
from trace_roofline.trace.parallel import share_cores, usable_cores

T = TypeVar("T")

# Costed-table columns that describe one op instance only: dropped (NA) when instances merge.
_INSTANCE_DETAIL = ("instance", "op_id", "op_name", "step", "M", "K", "N", "B", "T", "S", "causal", "shape")
# Costed-table columns that add up over merged instances (ts_us takes the first start).
_ADDITIVE = ("kernels", "time_us", "flops", "bytes")
DASK_CONNECT_TIMEOUT_S = 10  # how long to try to reach a scheduler address


@dataclass(frozen=True)
class Result:
    """What a worker sends back for one trace: small and picklable."""

    analysis: Analysis  # compacted (`compact`)
    rank: RankInfo


def compact(a: Analysis) -> Analysis:
    """`a` with its per-instance `costed` table shrunk to what reports read (every other field
    is already per operator or per phase, and is kept as is).

    Instances with a remark (no cost, or a preset mismatch) stay one row each: reports count them.
    The others merge per distinct value of every remaining column (phase, operator, layer,
    cost_kind, dtype, ...): kernels, time, FLOPs and bytes add up, `ts_us` is the first start and
    the instance details (`_INSTANCE_DETAIL`: instance and op ids, step, shape) become NA.
    Device time, FLOPs, bytes, coverage and every sum over a non-detail column are unchanged.
    """
    c = a.costed
    remark = c["uncosted"].notna() | c["check"].notna() | c["flops"].isna()
    plain = c[~remark]
    keys = [k for k in c.columns if k not in (*_INSTANCE_DETAIL, *_ADDITIVE, "ts_us")]
    merged = (plain.groupby(keys, dropna=False, sort=False, observed=True)
              .agg(ts_us=("ts_us", "min"), **{k: (k, "sum") for k in _ADDITIVE})
              .reset_index())
    digest = pd.concat([c[remark], merged.reindex(columns=c.columns)], ignore_index=True)
    digest = digest.astype(c.dtypes.to_dict()).sort_values("ts_us", kind="stable")
    return replace(a, costed=digest.reset_index(drop=True))


def analyze_path(path: str | os.PathLike, model: ModelSpec | None = None,
                 hardware: Hardware | None = None, options: AnalysisOptions | None = None,
                 run: Run | None = None) -> Result:
    """Load and analyse one trace (pipeline.analyze_trace) into a `Result`."""
    a = analyze_trace(path, model, hardware, options, run)
    meta = {"distributedInfo": a.distributed} if a.distributed is not None else {}
    # (rank_info takes any path, through str() and Path(): its annotation is narrower)
    return Result(compact(a), rank_info(cast("str | Path", path), meta))


@dataclass(frozen=True)
class Workers(Run):
    """`Run`'s cache and progress, and where the traces run: one after another in this process
    (`jobs` 1, no `dask`: the only mode where `progress` draws), on `jobs` local processes, or
    on a Dask cluster (`dask`: a scheduler address, or "local"; module docstring). The cache
    is copied to each worker."""

    jobs: int = 1
    dask: str | None = None

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise InputError(f"`jobs` must be at least 1, got {self.jobs}", "jobs")


def analyze_many(paths: Sequence[str | os.PathLike], model: ModelSpec | None = None,
                 hardware: Hardware | None = None,
                 options: AnalysisOptions | Sequence[AnalysisOptions] | None = None,
                 workers: Workers | None = None) -> list[Result]:
    """Analyse every trace of `paths`, each in one worker, as `workers` (default Workers())
    say. `options` are every trace's, or one per trace (each with its own `ncu`)."""
    workers = workers or Workers()
    each = (list(options) if isinstance(options, Sequence)
            else [options or AnalysisOptions()] * len(paths))
    if len(each) != len(paths):
        raise InputError(f"{len(each)} `options` for {len(paths)} `paths`: give one per path, "
                         "or one for all", "options")
    pairs = list(zip(paths, each, strict=True))
    work = partial(_analyze_pair, model=model, hardware=hardware, run=Run(cache=workers.cache))
    if workers.dask is not None:
        jobs = workers.jobs if workers.jobs > 1 else None
        local = (jobs or usable_cores()) if workers.dask == "local" else 1  # (a cluster's own)
        return _on_dask(partial(work, sharing=local), pairs, workers.dask, jobs)
    jobs = min(workers.jobs, len(pairs), usable_cores())  # never more processes than CPUs
    if jobs <= 1:
        here = Run(cache=workers.cache, progress=workers.progress)
        return [analyze_path(path, model, hardware, opts, here) for path, opts in pairs]
    return _on_processes(partial(work, sharing=jobs), pairs, jobs)


def _analyze_pair(pair: tuple[str | os.PathLike, AnalysisOptions], model: ModelSpec | None,
                  hardware: Hardware | None, run: Run, sharing: int) -> Result:
    """One worker's trace: analyze_path, as one of `sharing` workers on this machine's CPUs
    (its parse forks no helper unless each of them can have two: share_cores)."""
    share_cores(sharing)
    return analyze_path(pair[0], model, hardware, pair[1], run)


def bounded_map(submit: Callable[[T], Any], wait: Callable, items: Iterable[T],
                window: int) -> list:
    """[f(item) for item in items] through `submit` (item -> future), with at most `window`
    futures outstanding; `wait(futures, return_when="FIRST_COMPLETED")` -> (done, not_done), as
    concurrent.futures.wait and distributed.wait do. Results in item order; a future's error is
    raised as soon as it is seen (the items not yet submitted never are)."""
    todo = iter(enumerate(items))
    pending = {submit(item): i for i, item in islice(todo, window)}
    results: dict[int, Any] = {}
    while pending:
        done, _ = wait(list(pending), return_when="FIRST_COMPLETED")
        for future in done:
            results[pending.pop(future)] = future.result()
        pending |= {submit(item): i for i, item in islice(todo, len(done))}
    return [results[i] for i in range(len(results))]


def _on_processes(work: Callable[[tuple], Result], pairs: list[tuple], jobs: int) -> list[Result]:
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_pool_worker)
    try:
        return bounded_map(lambda pair: pool.submit(work, pair), cf.wait, pairs, jobs)
    except BrokenProcessPool:
        raise InputError(f"a worker process died while analysing traces with `jobs` {jobs} "
                         "(killed, e.g. out of memory): try fewer jobs") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _pool_worker() -> None:
    """A --jobs worker's set-up: the CLI's memory settings."""
    memory.tune()


def _on_dask(work: Callable[[tuple], Result], pairs: list[tuple], address: str,
             jobs: int | None) -> list[Result]:
    try:
        import distributed
    except ImportError:
        raise InputError("`dask` needs the optional extra: pip install 'trace-roofline[dask]'",
                         "dask") from None
    if address == "local":
        cluster: Any = distributed.LocalCluster(
            n_workers=jobs or usable_cores(), threads_per_worker=1,
            processes=True, dashboard_address=None)
    else:
        cluster = nullcontext(address)
    with cluster as target:
        try:
            client = distributed.Client(target, timeout=DASK_CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            raise InputError(f"`dask` {address}: cannot reach a Dask scheduler ({e})", "dask") from None
        with client:
            window = jobs or sum(client.nthreads().values()) or 1
            submit = partial(client.submit, work, pure=False)
            try:
                return bounded_map(submit, distributed.wait, pairs, window)
            except distributed.KilledWorker as e:
                raise InputError(f"`dask` {address}: a worker died while analysing traces ({e})",
                                 "dask") from None
