"""Device ceilings: a frozen `Hardware`, cited presets, lookup by trace GPU name, JSON files."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from trace_roofline.errors import InputError
from trace_roofline.files import read_json
from trace_roofline.model import dtypes

T = 1e12
G = 1e9


def dtype_key(dtype: str) -> str:
    """The `peak_flops` key of a dtype spelling ('c10::BFloat16', 'torch.float16', 'bf16' ->
    'bf16'); an InputError for an unknown dtype or one no hardware lists a peak for (int8)."""
    d = dtypes.lookup(dtype)
    if d is None:
        raise InputError(f"unknown dtype {dtype!r} for a compute peak")
    if d.peak is None:
        peaks = sorted({x.peak for x in dtypes.DTYPES if x.peak})
        raise InputError(f"dtype {dtype!r} has no compute peak (peaks: {', '.join(peaks)})")
    return d.peak


@dataclass(frozen=True)
class Hardware:
    """Roofline ceilings of one device: dense peak FLOP/s per dtype, memory bandwidth and the
    interconnect bandwidth collectives are placed against (`link_bandwidth`: bytes/s per
    direction, the ceiling of nccl-tests' bus bandwidth; None when unknown)."""

    name: str
    peak_flops: dict[str, float]  # dtype key -> dense FLOP/s (no 2:4 sparsity)
    mem_bandwidth: float  # bytes/s, DRAM/HBM
    source: str
    device_names: tuple[str, ...] = ()  # `deviceProperties[].name` values that mean this device
    extra: dict[str, object] = field(default_factory=dict)  # date, method, ... for measured files
    link_bandwidth: float | None = None  # bytes/s per direction, GPU to GPU
    link_source: str = ""
    # the last on-chip cache before DRAM (L2; MI300X: its Infinity Cache), bytes, None unknown:
    # a kernel whose bytes fit in it can beat the DRAM roof by reuse
    l2_bytes: float | None = None

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for a dtype."""
        key = dtype_key(dtype)
        if key in self.peak_flops:
            return self.peak_flops[key]
        raise InputError(f"`hardware` {self.name!r} has no {key} peak (has: {', '.join(self.peak_flops)})",
                             "hardware")

    def ridge(self, dtype: str = "bf16") -> float:
        """Ridge intensity I* = P / B_mem in FLOP/byte."""
        return self.peak(dtype) / self.mem_bandwidth

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["device_names"] = list(self.device_names)
        extra = d.pop("extra")
        if self.link_bandwidth is None:
            del d["link_bandwidth"], d["link_source"]
        if self.l2_bytes is None:
            del d["l2_bytes"]
        return {**d, **extra}


# Interconnect per direction. NVLink 4 (H100/H200 SXM): 900 GB/s total = 450 GB/s each way
# (NVIDIA H100 and H200 datasheets); NVLink 3 (A100 SXM): 600 GB/s total = 300 GB/s each way
# (A100 datasheet); GeForce RTX 4090 / 3080 have no NVLink: PCIe 4.0 x16, 16 GT/s x 16 lanes x
# 128/130 encoding = 31.5 GB/s each way (PCI-SIG PCIe 4.0 base specification).
_NVLINK4 = (450 * G, "NVLink 4, 900 GB/s bidirectional = 450 GB/s per direction (datasheet)")
_NVLINK3 = (300 * G, "NVLink 3, 600 GB/s bidirectional = 300 GB/s per direction (A100 datasheet)")
_PCIE4 = (31.5 * G, "no NVLink: PCIe 4.0 x16, 31.5 GB/s per direction (PCIe 4.0 spec)")
_PCIE3 = (15.75 * G, "no NVLink: PCIe 3.0 x16, 15.75 GB/s per direction (PCIe 3.0 spec)")
# NVLink 2 (V100 SXM2): 300 GB/s total = 150 GB/s each way (Tesla V100 datasheet); H800 SXM:
# NVLink 400 GB/s total = 200 GB/s each way (H800 datasheet).
_NVLINK2 = (150 * G, "NVLink 2, 300 GB/s bidirectional = 150 GB/s per direction (V100 datasheet)")
_NVLINK_H800 = (200 * G, "NVLink 400 GB/s bidirectional = 200 GB/s per direction "
                         "(H800 datasheet)")
# NVLink 5 (B200, GB200): 1.8 TB/s total = 900 GB/s each way (NVIDIA DGX B200 / GB200 NVL72
# datasheets); H20 keeps Hopper's NVLink 4 (900 GB/s total, NVIDIA H20 product brief).
_NVLINK5 = (900 * G, "NVLink 5, 1.8 TB/s bidirectional = 900 GB/s per direction (datasheet)")
# AMD Infinity Fabric (MI300X, MI325X): 7 links of 128 GB/s bidirectional = 64 GB/s per link
# and direction; a rank of an 8-GPU platform reaches its 7 peers at 7 x 64 = 448 GB/s per
# direction, the ceiling of its bus bandwidth. MI355X: 7 links of 153.6 GB/s bidirectional
# (76.8 per direction, AMD Instinct MI355X data sheet), 537.6 GB/s per direction in all.
_XGMI3 = (448 * G, "Infinity Fabric: 7 links x 64 GB/s per direction = 448 GB/s "
                   "(AMD Instinct MI300X / MI325X data sheets)")
_XGMI4 = (537.6 * G, "Infinity Fabric: 7 links x 76.8 GB/s per direction = 537.6 GB/s "
                     "(AMD Instinct MI355X data sheet)")
_AMD_DOCS = "https://www.amd.com/en/products/accelerators/instinct"
# Last-level cache before DRAM. GH100 (H100, H200, H800, GH200: one die): 50 MB L2 (NVIDIA
# H100 Tensor Core GPU Architecture whitepaper); GA100 (A100): 40 MB L2 (NVIDIA A100 Tensor
# Core GPU Architecture whitepaper); B200: 126 MB L2 over its two dies (Chips and Cheese,
# "Nvidia's B200: Keeping the CUDA Juggernaut Rolling", measured); MI300X: 256 MB AMD
# Infinity Cache (AMD Instinct MI300X data sheet; its L2 is 4 MB per XCD).
MB = 1e6
_L2_HOPPER, _L2_AMPERE, _L2_B200, _L2_MI300X = 50 * MB, 40 * MB, 126 * MB, 256 * MB

# A100's dense tensor rates (A100 datasheet: every column alike)
_AMPERE = {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}
# Hopper's dense tensor rates (H100 SXM datasheet; the H200, H800 and GH200 share its die)
_HOPPER = {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T,
           "fp8": 1978.9 * T}

PRESETS: dict[str, Hardware] = {
    "rtx4090": Hardware(
        "rtx4090",
        # Tensor rates with FP32 accumulate (GeForce runs FP16-accumulate at 2x).
        {"bf16": 165.2 * T, "fp16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T, "fp8": 330.3 * T},
        1008 * G,
        "NVIDIA Ada Lovelace architecture whitepaper v2.1, RTX 4090 column (dense tensor, FP32 accumulate)",
        ("NVIDIA GeForce RTX 4090",),
        link_bandwidth=_PCIE4[0], link_source=_PCIE4[1],
    ),
    "rtx3080": Hardware(
        "rtx3080",
        {"bf16": 59.5 * T, "fp16": 59.5 * T, "tf32": 29.8 * T, "fp32": 29.8 * T},
        760 * G,
        "NVIDIA Ampere GA102 whitepaper v2.0, RTX 3080 column (dense tensor, FP32 accumulate)",
        ("NVIDIA GeForce RTX 3080",),
        link_bandwidth=_PCIE4[0], link_source=_PCIE4[1],
    ),
    "a100-sxm": Hardware(
        "a100-sxm",
        dict(_AMPERE),
        2039 * G,
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM, dense)",
        ("NVIDIA A100-SXM4-80GB",),
        l2_bytes=_L2_AMPERE, link_bandwidth=_NVLINK3[0], link_source=_NVLINK3[1],
    ),
    # The A100 datasheet's other columns: the same dense tensor rates, less HBM bandwidth
    # (40GB SXM and 40GB PCIe 1,555 GB/s; 80GB PCIe 1,935 GB/s). A PCIe card without an
    # NVLink bridge reaches its peers over PCIe 4.0.
    "a100-sxm-40gb": Hardware(
        "a100-sxm-40gb",
        dict(_AMPERE),
        1555 * G,
        "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM column, dense): 1,555 GB/s HBM2",
        ("NVIDIA A100-SXM4-40GB",),
        link_bandwidth=_NVLINK3[0], link_source=_NVLINK3[1],
    ),
    "a100-pcie": Hardware(
        "a100-pcie",
        dict(_AMPERE),
        1935 * G,
        "NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe column, dense): 1,935 GB/s HBM2e",
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-80GB"),
        link_bandwidth=_PCIE4[0], link_source=_PCIE4[1],
    ),
    "a100-pcie-40gb": Hardware(
        "a100-pcie-40gb",
        dict(_AMPERE),
        1555 * G,
        "NVIDIA A100 Tensor Core GPU datasheet (40GB PCIe column, dense): 1,555 GB/s HBM2",
        ("NVIDIA A100-PCIE-40GB",),
        link_bandwidth=_PCIE4[0], link_source=_PCIE4[1],
    ),
    "h100-sxm": Hardware(
        "h100-sxm",
        dict(_HOPPER),
        3350 * G,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)",
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100"),
        l2_bytes=_L2_HOPPER, link_bandwidth=_NVLINK4[0], link_source=_NVLINK4[1],
    ),
    "h200-sxm": Hardware(
        "h200-sxm",
        dict(_HOPPER),
        4800 * G,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)",
        ("NVIDIA H200",),
        l2_bytes=_L2_HOPPER, link_bandwidth=_NVLINK4[0], link_source=_NVLINK4[1],
    ),
    # H800: the H100 SXM's die and HBM3 with NVLink cut to 400 GB/s in all (NVIDIA H800
    # Tensor Core GPU datasheet, SXM column: FP16/BF16 1,979 and FP8 3,958 TFLOPS with
    # sparsity, i.e. 989.4 / 1,978.9 dense; 3.35 TB/s).
    "h800-sxm": Hardware(
        "h800-sxm",
        dict(_HOPPER),
        3350 * G,
        "NVIDIA H800 Tensor Core GPU datasheet (SXM, dense: half the sparse figures), 3.35 TB/s HBM3",
        ("NVIDIA H800",),
        l2_bytes=_L2_HOPPER, link_bandwidth=_NVLINK_H800[0], link_source=_NVLINK_H800[1],
    ),
    # GH200's Hopper GPU: the H100 SXM's tensor rates (NVIDIA GH200 Grace Hopper Superchip
    # datasheet: FP16/BF16 990 TFLOPS dense, FP8 1,979, TF32 494, FP32 67), HBM3 96 GB at
    # 4 TB/s (the "480GB" part: 480 GB of LPDDR5X beside it) or HBM3e 144 GB at 4.9 TB/s;
    # NVLink 4 to other superchips (900 GB/s in all).
    "gh200": Hardware(
        "gh200",
        dict(_HOPPER),
        4000 * G,
        "NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 at 4 TB/s, dense tensor rates)",
        ("NVIDIA GH200 480GB", "NVIDIA GH200"),
        link_bandwidth=_NVLINK4[0], link_source=_NVLINK4[1],
    ),
    "gh200-144g": Hardware(
        "gh200-144g",
        dict(_HOPPER),
        4900 * G,
        "NVIDIA GH200 Grace Hopper Superchip datasheet (144 GB HBM3e at 4.9 TB/s, dense tensor rates)",
        ("NVIDIA GH200 144G HBM3e", "NVIDIA GH200 624GB"),
        link_bandwidth=_NVLINK4[0], link_source=_NVLINK4[1],
    ),
    # Volta has no bf16 tensor cores: fp16 (FP32 accumulate) and fp32 only (NVIDIA Tesla V100
    # GPU datasheet: SXM2 125 tensor TFLOPS, 15.7 FP32; PCIe 112 and 14; 900 GB/s HBM2 both;
    # NVLink 2 300 GB/s in all on SXM2).
    "v100-sxm2": Hardware(
        "v100-sxm2",
        {"fp16": 125 * T, "fp32": 15.7 * T},
        900 * G,
        "NVIDIA Tesla V100 GPU datasheet (SXM2 column): 125 TFLOPS fp16 tensor, 900 GB/s HBM2",
        ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB", "Tesla V100-SXM2-32GB-LS"),
        link_bandwidth=_NVLINK2[0], link_source=_NVLINK2[1],
    ),
    "v100-pcie": Hardware(
        "v100-pcie",
        {"fp16": 112 * T, "fp32": 14 * T},
        900 * G,
        "NVIDIA Tesla V100 GPU datasheet (PCIe column): 112 TFLOPS fp16 tensor, 900 GB/s HBM2",
        ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"),
        link_bandwidth=_PCIE3[0], link_source=_PCIE3[1],
    ),
    # NVIDIA L4 datasheet: FP16/BF16 242, FP8 485, TF32 120 TFLOPS with sparsity (half dense),
    # FP32 30.3 TFLOPS, 300 GB/s GDDR6, PCIe 4.0 x16.
    "l4": Hardware(
        "l4",
        {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T, "fp8": 242.5 * T},
        300 * G,
        "NVIDIA L4 Tensor Core GPU datasheet (dense: half the sheet's sparse figures), "
        "300 GB/s GDDR6",
        ("NVIDIA L4",),
        link_bandwidth=_PCIE4[0], link_source=_PCIE4[1],
    ),
    # AMD Instinct (CDNA 3 / CDNA 4): peak theoretical dense matrix rates, no sparsity.
    "mi300x": Hardware(
        "mi300x",
        {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T, "fp32": 163.4 * T,
         "fp8": 2614.9 * T},
        5300 * G,
        "AMD Instinct MI300X Accelerator data sheet (amd-instinct-mi300x-data-sheet.pdf, "
        f"{_AMD_DOCS}/mi300/mi300x.html): dense matrix peaks, 5.3 TB/s HBM3",
        ("AMD Instinct MI300X", "AMD Instinct MI300X VF", "AMD Instinct MI300X HF",
         "AMD Instinct MI300X OAM"),
        l2_bytes=_L2_MI300X, link_bandwidth=_XGMI3[0], link_source=_XGMI3[1],
    ),
    "mi325x": Hardware(
        "mi325x",
        {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T, "fp32": 163.4 * T,
         "fp8": 2614.9 * T},
        6000 * G,
        "AMD Instinct MI325X Accelerator data sheet (amd-instinct-mi325x-datasheet.pdf, "
        f"{_AMD_DOCS}/mi300/mi325x.html): the MI300X's compute, 6 TB/s HBM3E",
        ("AMD Instinct MI325X", "AMD Instinct MI325X VF", "AMD Instinct MI325X OAM"),
        link_bandwidth=_XGMI3[0], link_source=_XGMI3[1],
    ),
    "mi355x": Hardware(
        "mi355x",
        {"bf16": 2516.6 * T, "fp16": 2516.6 * T, "fp32": 157.3 * T, "fp8": 5033.2 * T,
         "fp4": 10066.3 * T},
        8000 * G,
        "AMD Instinct MI355X GPU data sheet (amd-instinct-mi355x-gpu-data-sheet.pdf, "
        f"{_AMD_DOCS}/mi350/mi355x.html): dense matrix peaks (MXFP4 as fp4), 8 TB/s HBM3E",
        ("AMD Instinct MI355X", "AMD Instinct MI355X VF", "AMD Instinct MI355X OAM"),
        link_bandwidth=_XGMI4[0], link_source=_XGMI4[1],
    ),
    # AMD Instinct MI250X data sheet: 383 TFLOPS FP16/BF16 and 95.7 FP32 matrix, 3.2 TB/s HBM2e
    # for the OAM module of two graphics compute dies (GCDs); ROCm shows each GCD as a device
    # of its own (64 GB), so a trace's device is half the module: 191.5 TFLOPS, 1.6 TB/s.
    # The GCDs' links depend on the platform (no link ceiling here: give a hardware JSON).
    "mi250x": Hardware(
        "mi250x",
        {"bf16": 191.5 * T, "fp16": 191.5 * T, "fp32": 47.85 * T},
        1600 * G,
        "AMD Instinct MI250X data sheet (amd-instinct-mi250x-data-sheet.pdf, "
        f"{_AMD_DOCS}/mi200/mi250x.html): per GCD, half the module's 383 TFLOPS "
        "FP16/BF16 and 3.2 TB/s HBM2e",
        ("AMD Instinct MI250X", "AMD Instinct MI250X / MI250", "AMD Instinct MI250X/MI250"),
    ),
    # NVIDIA Blackwell, Hopper (China SKU), Ada: dense tensor rates (half the sparse figures)
    "b200": Hardware(
        "b200",
        {"bf16": 2250 * T, "fp16": 2250 * T, "tf32": 1100 * T, "fp32": 80 * T,
         "fp8": 4500 * T, "fp4": 9000 * T},
        8000 * G,
        "NVIDIA DGX B200 datasheet / Blackwell architecture technical brief, HGX B200 at 1000 W "
        "(https://www.nvidia.com/en-us/data-center/dgx-b200/): dense, NVFP4 as fp4",
        ("NVIDIA B200",),
        l2_bytes=_L2_B200, link_bandwidth=_NVLINK5[0], link_source=_NVLINK5[1],
    ),
    "gb200": Hardware(
        "gb200",
        {"bf16": 2500 * T, "fp16": 2500 * T, "tf32": 1250 * T, "fp32": 90 * T,
         "fp8": 5000 * T, "fp4": 10000 * T},
        8000 * G,
        "NVIDIA GB200 NVL72 datasheet, per Blackwell GPU at 1200 W "
        "(https://www.nvidia.com/en-us/data-center/gb200-nvl72/): dense, NVFP4 as fp4",
        ("NVIDIA GB200",),
        link_bandwidth=_NVLINK5[0], link_source=_NVLINK5[1],
    ),
    "h20": Hardware(
        "h20",
        {"bf16": 148 * T, "fp16": 148 * T, "tf32": 74 * T, "fp32": 44 * T, "fp8": 296 * T},
        4000 * G,
        "NVIDIA H20 product brief (HGX H20, 96 GB HBM3): dense tensor rates, 4.0 TB/s",
        ("NVIDIA H20",),
        link_bandwidth=_NVLINK4[0], link_source=_NVLINK4[1],
    ),
    "l40s": Hardware(
        "l40s",
        {"bf16": 362.05 * T, "fp16": 362.05 * T, "tf32": 183 * T, "fp32": 91.6 * T,
         "fp8": 733 * T},
        864 * G,
        "NVIDIA L40S datasheet (https://www.nvidia.com/en-us/data-center/l40s/): dense tensor "
        "rates (the sheet's starred figures are with sparsity), 864 GB/s GDDR6",
        ("NVIDIA L40S",),
        link_bandwidth=_PCIE4[0], link_source=_PCIE4[1],
    ),
}

# A device whose trace names no GPU (ROCm builds may leave deviceProperties' name empty) is
# known by its properties: (computeMajor, computeMinor, numSms, GiB of memory rounded) -> preset.
# gfx942 (CDNA 3) with 304 CUs is an MI300X (192 GiB) or MI325X (256 GiB); gfx950 with 256 CUs
# and 288 GB an MI355X.
SIGNATURES: dict[tuple[int, int, int, int], str] = {
    (9, 4, 304, 192): "mi300x",
    (9, 4, 304, 256): "mi325x",
    (9, 5, 256, 288): "mi355x",
}

MEASURED_FILES = {"h200-measured": "h200_measured.json"}  # committed `trace-roofline calibrate` runs


def from_json(path: str | Path) -> Hardware:
    """Load ceilings from a JSON file: {"name", "peak_flops": {dtype: FLOP/s}, "mem_bandwidth": B/s,
    "source", optional "device_names", "link_bandwidth" (B/s per direction: collectives' roof)
    and "link_source", "l2_bytes" (the last cache before DRAM), anything else kept in `extra`
    (date, method, ...)}."""
    p = Path(path)
    raw = read_json(p)
    return _from_dict(raw, str(p))


def _ceiling(where: str, name: str, v: object) -> float:
    """A ceiling (FLOP/s, bytes/s): a positive finite number, else an InputError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{where}: {name} must be a number, got {v!r}")
    try:
        x = float(v)
    except OverflowError:  # (an integer beyond any float: 10**400)
        x = math.inf
    if not (math.isfinite(x) and x > 0):
        text = repr(v) if len(repr(v)) <= 40 else f"an integer of {len(repr(v))} digits"
        raise InputError(f"{where}: non-positive or non-finite ceiling for {name}, got {text}")
    return x


def _from_dict(raw: object, where: str) -> Hardware:
    if not isinstance(raw, dict):
        raise InputError(f"{where}: hardware file must hold a JSON object")
    missing = [k for k in ("name", "peak_flops", "mem_bandwidth") if k not in raw]
    if missing:
        raise InputError(f"{where}: hardware file lacks {', '.join(missing)}")
    peaks = raw["peak_flops"]
    if not isinstance(peaks, dict) or not peaks:
        raise InputError(f"{where}: peak_flops must be a non-empty object of dtype -> FLOP/s")
    try:
        peak_flops = {dtype_key(k): _ceiling(where, f"peak_flops[{k!r}]", v) for k, v in peaks.items()}
    except InputError as e:
        raise e if str(e).startswith(where) else InputError(f"{where}: {e}") from None
    bw = _ceiling(where, "mem_bandwidth", raw["mem_bandwidth"])
    link = raw.get("link_bandwidth")
    link = None if link is None else _ceiling(where, "link_bandwidth", link)
    names = raw.get("device_names") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InputError(f"{where}: device_names must be a list of strings, got {names!r}")
    l2 = raw.get("l2_bytes")
    l2 = None if l2 is None else _ceiling(where, "l2_bytes", l2)
    known = {"name", "peak_flops", "mem_bandwidth", "source", "device_names", "link_bandwidth",
             "link_source", "l2_bytes"}
    return Hardware(
        name=str(raw["name"]),
        peak_flops=peak_flops,
        mem_bandwidth=bw,
        source=str(raw.get("source", where)),
        device_names=tuple(names),
        extra={k: v for k, v in raw.items() if k not in known},
        link_bandwidth=link,
        link_source=str(raw.get("link_source", "" if link is None else where)),
        l2_bytes=l2,
    )


def measured(name: str) -> Hardware | None:
    """A committed measured preset (e.g. 'h200-measured'), or None if its file is absent."""
    fname = MEASURED_FILES.get(name)
    if fname is None:
        return None
    res = resources.files("trace_roofline.model") / "data" / fname
    if not res.is_file():
        return None
    hw = _from_dict(json.loads(res.read_text()), f"trace_roofline/data/{fname}")
    # a calibration measures no cache: its device's datasheet preset gives the L2
    same = [p.l2_bytes for p in PRESETS.values() if set(p.device_names) & set(hw.device_names)]
    return hw if hw.l2_bytes is not None or not same else replace(hw, l2_bytes=same[0])


def names() -> list[str]:
    """All preset names, measured ones included when their files are present."""
    return [*PRESETS, *(n for n in MEASURED_FILES if measured(n) is not None)]


def get_hardware(name_or_path: str) -> Hardware:
    """A preset by name, a measured preset, or a JSON file path."""
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    hw = measured(key)
    if hw is not None:
        return hw
    if name_or_path.endswith(".json") or Path(name_or_path).exists():
        return from_json(name_or_path)
    raise InputError(
        f"unknown hardware {name_or_path!r} (presets: {', '.join(names())}; or a JSON file path)"
    )


def for_device_name(device_name: str, prefer_measured: bool = True) -> Hardware | None:
    """The hardware a trace's `deviceProperties[].name` denotes ('NVIDIA H200' -> h200), or None.

    With `prefer_measured`, a committed calibration of that device wins over its datasheet preset.
    """
    wanted = device_name.strip().lower()
    candidates = [measured(n) for n in MEASURED_FILES] if prefer_measured else []
    candidates += list(PRESETS.values())
    for hw in candidates:
        if hw is not None and any(wanted == d.lower() for d in hw.device_names):
            return hw
    return None


def _gib(nbytes: object) -> int | None:
    if not isinstance(nbytes, (int, float, str)):
        return None
    try:
        return round(float(nbytes) / 2**30)
    except ValueError:
        return None


def _signature(props: dict) -> tuple[int, int, int, int] | None:
    keys = ("computeMajor", "computeMinor", "numSms")
    if not all(isinstance(props.get(k), int) for k in keys):
        return None
    gib = _gib(props.get("totalGlobalMem"))
    if gib is None:
        return None
    major, minor, sms = (int(props[k]) for k in keys)
    # 288 GB (MI355X) is 268 GiB: match HBM sizes as vendors state them, within 8%
    for sig, _ in SIGNATURES.items():
        if sig[:3] == (major, minor, sms) and abs(gib - sig[3]) <= 0.08 * sig[3] + 1:
            return sig
    return None


def for_device_properties(props: dict) -> tuple[Hardware | None, str]:
    """The hardware one `deviceProperties` entry denotes and how it was known: by its name
    (`for_device_name`), else, for an entry without a name, by its properties (`SIGNATURES`:
    compute capability, multiprocessors, memory); None and a message naming the device and
    asking for --hardware when neither knows it."""
    name = str(props.get("name") or "").strip()
    if name:
        hw = for_device_name(name)
        if hw is not None:
            return hw, f"the trace's device {name!r}"
        return None, (f"device {name!r} in the trace has no preset: pass --hardware (a preset: "
                      f"{', '.join(names())}; or a hardware JSON file)")
    sig = _signature(props)
    if sig is not None:
        return PRESETS[SIGNATURES[sig]], (
            f"the trace names no device; its properties (compute {sig[0]}.{sig[1]}, {sig[2]} "
            f"multiprocessors, {_gib(props.get('totalGlobalMem'))} GiB) are a "
            f"{SIGNATURES[sig]}'s")
    desc = ", ".join(f"{k} {props[k]}" for k in ("computeMajor", "computeMinor", "numSms",
                                                  "totalGlobalMem") if k in props)
    return None, (f"the trace names no device ({desc or 'no properties'}): pass --hardware "
                  f"(a preset: {', '.join(names())}; or a hardware JSON file)")


def trace_device(device_properties: list[dict]) -> tuple[Hardware | None, str]:
    """The hardware of a trace's `deviceProperties` (its first entry that a preset knows) and
    what says so, or None and a message naming the device and asking for --hardware."""
    if not device_properties:
        return None, "the trace holds no deviceProperties: give --hardware for a roofline"
    first_msg = ""
    for props in device_properties:
        hw, msg = for_device_properties(props if isinstance(props, dict) else {})
        if hw is not None:
            return hw, msg
        first_msg = first_msg or msg
    return None, first_msg
