"""Stage 1: read a torch.profiler (Kineto) Chrome trace into typed pandas tables.

`load_trace(path)` reads a `.json`, a `.json.gz` (gzip is sniffed from the magic bytes, not the
name) or a directory holding one `tensorboard_trace_handler` file (`*.pt.trace.json[.gz]`);
`load_traces(dir)` returns one `Trace` per file. Inputs are only ever opened for reading.

The package, in the order the bytes flow (figures in benchmarks/README.md):
- load.py: the entry points (`load_trace`, `load_traces`, `parse_dims`, `progress_bar`);
- read.py: a file's bytes (directory listing, gunzip, a `Window` that reads a plain file 16 MiB
  at a time into one buffer as it is decoded, so the file is never in memory whole), every read
  through the one descriptor opened first and checked against that file's identity;
- decode.py: bytes -> events. The events array is cut between two events every ~1 MiB and
  each batch is decoded in place by msgspec into GC-free Structs that carry only the fields the
  tables use (everything else in an event is skipped by the C decoder); every cut is proven by
  the batches decoding as JSON arrays, else the document is read whole, as one zero-copy `Raw`
  slice per event;
- columns.py: events -> columns. Each batch's rows are grouped by table, then become columns
  at once with C-level `map`/`attrgetter`/`np.fromiter`; strings become categorical codes and
  the structs are freed before the next batch, so memory stays near the columns' size. Shape
  arrays (`Input Dims`, `Input type`, `Input Strides`, `Concrete Inputs`) stay raw JSON text;
  decode them lazily, for the rows that need them, with `parse_dims`;
- schema.py: the tables' declared columns and the `Trace` holding them;
- parallel.py: the two-process parse. Big files use a second core (msgspec holds the GIL, so
  a forked process): the parent decodes the events from the front while the worker decodes
  them from the back, each claiming bytes under a shared lock, so that they meet wherever
  their speeds make them meet, and the worker pipes its columns back; the result, and any
  error, is exactly the one-process result. `load_trace(path, workers=...)` says when it is
  used.

Schema variants handled (Kineto's ChromeTraceLogger, old and new, and HTA's test traces):
- categories: kernel/Kernel, gpu_memcpy/Memcpy, gpu_memset/Memset, cpu_op/Operator,
  cuda_runtime/cuda_driver/Runtime/any `*_runtime` or `*_driver` (hip, xpu, privateuse1),
  user_annotation/gpu_user_annotation, python_function; flows ac2g, async_cpu_to_gpu,
  async_gpu and the 2020 `async` launch flows. Matching is case-insensitive.
- `External id` or the 2020 spelling `external id`; `Input Dims` or `Input dims`; any of them
  missing; `args` missing; pid/tid as strings ("stream 7", "Spans": non-numeric labels become
  <NA>, device rows keep their `device`/`stream` from args); ts/dur as ints or floats;
  `deviceProperties` absent; a top-level JSON array of events (Chrome's "JSON Array Format").
- `cpu_op` ranges named `ProfilerStep#N` (older PyTorch) are moved to `annotations`.
- CPU-only traces (no device rows) are valid: their cpu ops are the timed units (`cpu_only`).

Bad input (policy, see tests/test_robustness.py): anything that makes the file unreadable as a
whole raises `InputError("<file>: <problem>")` -- missing file, empty directory, truncated or
malformed JSON, corrupt gzip, invalid UTF-8 in a field we read, nesting too deep, wrong
top-level type, `traceEvents` missing or not a list, and a trace with no kernels and no cpu ops.
A file rewritten while it is read is read again, whole (the Raw way), as it is then; rewritten
again meanwhile, it is `InputError("<file>: changed while it was being read")`. What holds for
hostile input (crafted names, huge strings, a full $TMPDIR, files replaced or rewritten) is in
docs/security.md (kept by tests/test_hostile_ingest.py).
Single bad events are skipped and counted in `meta["skipped_events"]` (reason -> count): ph,
cat, name, ts or dur of the wrong type (or a number out of float range), a complete ('X') event
without ts/dur, a negative or longer-than-a-day duration, a device/cpu category with a phase
other than 'X', a flow without ts. Timing is never dropped for a bad link: an event whose args,
pid, tid or id are malformed keeps its timing, those fields become <NA>, and it is counted in
`meta["events_with_dropped_fields"]`.
"""

from trace_roofline.trace.load import PROGRESS_MIN_BYTES, load_trace, load_traces, parse_dims, progress_bar
from trace_roofline.trace.read import trace_files
from trace_roofline.trace.schema import (
    ANNOTATION_COLUMNS,
    CPU_OP_COLUMNS,
    DEVICE_COLUMNS,
    FLOW_COLUMNS,
    MAX_DUR_US,
    MAX_TS_US,
    PYTHON_FRAME_COLUMNS,
    RUNTIME_COLUMNS,
    SCHEMAS,
    Progress,
    Trace,
)

__all__ = [
    "ANNOTATION_COLUMNS", "CPU_OP_COLUMNS", "DEVICE_COLUMNS", "FLOW_COLUMNS", "MAX_DUR_US",
    "MAX_TS_US", "PROGRESS_MIN_BYTES", "PYTHON_FRAME_COLUMNS", "RUNTIME_COLUMNS", "SCHEMAS",
    "Progress", "Trace", "load_trace", "load_traces", "parse_dims", "progress_bar",
    "trace_files",
]
