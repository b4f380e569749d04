"""Lowering and compiling for an accelerator on a host without one: the chip the kernels are
told they target, and a reading of the module. Used by benchmarks/lowering.py (jax.export),
benchmarks/compile.py (the TPU compiler through libtpu, XLA's GPU compiler through jax's CUDA
plugin) and the tests' lowering checks.

Pallas sizes a kernel for the chip it lowers for, which it reads from the device of the
abstract mesh in context, else from the default device, here a CPU (which it refuses).
`target` names the chip while a function is lowered: over a TPU topology's or GPU hosts'
compile-only devices, their mesh (the real chip); exported from this host's devices, a stand-in
for this host's device kind, an H100 for cuda (with jax's queries of the cuDNN version, which a
CPU jaxlib cannot answer, at 9.10, and of the GPU's compute capability at the chip's), a TPU
generation for tpu (v5e unless told).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import sys
from unittest import mock

import jax
from jax._src import cloud_tpu_init, xla_bridge
from jax._src import lib as jax_lib
from jax._src.lib import xla_client
from jax._src.cudnn import fused_attention_stablehlo
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir, passmanager
from jax._src.pallas.triton import gpu_info
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import topologies

try:
    from jax._src.pallas.mosaic import tpu_info
except ImportError:  # a jaxlib without Mosaic
    tpu_info = None

TRITON = "__gpu$xla.gpu.triton"  # a Pallas kernel on GPU
MOSAIC = "tpu_custom_call"  # a Pallas kernel (ours or splash) on TPU
CUDNN = "__cudnn$fmha"  # prefix of jax's cuDNN flash-attention calls
# Custom calls without a serialization guarantee: an exported module is for inspection only.
UNSTABLE_CALLS = (TRITON, *(f"{CUDNN}{name}" for name in (
    "Softmax", "SoftmaxBackward", "ScaleBiasSoftmax", "ScaleBiasSoftmaxBackward", "SoftmaxDropout",
    "SoftmaxDropoutBackward", "ScaleBiasSoftmaxDropout", "ScaleBiasSoftmaxDropoutBackward", "SoftmaxF8",
    "SoftmaxBackwardF8")))


def memory(compiled) -> dict:
    """The compiler's memory analysis of the program each device runs, in bytes."""
    mem = compiled.memory_analysis()
    out = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
           "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes}
    # Donated state is aliased to the output: it is counted once.
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def _chip_info(platform: str, chip: str):
    """The hardware description Pallas would read on `chip` ("H100"; "TPU_V5E", ...)."""
    if platform == "cuda":
        return gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion[chip])
    if tpu_info is None:
        raise ValueError("this jaxlib has no Mosaic TPU support to lower for tpu")
    return tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion[chip], 1)


@contextlib.contextmanager
def target(platform: str, mesh: jax.sharding.Mesh | None = None, chip: str | None = None):
    """While the block runs, Pallas kernels lower for the chip of `mesh`'s devices where they are
    the platform's (a TPU topology's, GPU hosts'), else for `chip` (default H100 for cuda, TPU_V5E for tpu),
    stood in for this host's device kind; on cuda jax's cuDNN version query answers 9.10 and its
    compute capability queries the chip's, and each Triton module is verified as it is lowered."""
    if platform not in ("cuda", "tpu"):
        yield
        return
    with contextlib.ExitStack() as stack:
        if mesh is not None and mesh.devices.flat[0].platform == {"cuda": "gpu"}.get(platform, platform):
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        else:
            registry = (gpu_info if platform == "cuda" else tpu_info).registry
            info = _chip_info(platform, chip or ("H100" if platform == "cuda" else "TPU_V5E"))
            stack.enter_context(mock.patch.dict(registry, {jax.devices()[0].device_kind: lambda: info}))
        if platform == "cuda":
            # The module through MLIR's verifier, as XLA runs it when it parses the module on a
            # GPU: a kernel that lowers but would not compile there (loop bounds of two types,
            # say) fails here, on this host.
            stack.enter_context(_after_lowering(lambda module: module.operation.verify()))
            capability = _chip_info("cuda", chip or "H100").compute_capability  # 90 for 9.0
            stack.enter_context(mock.patch.object(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000))
            for name, test in (("check_compute_capability", lambda c: capability >= _capability(c)),
                               ("is_cuda_compute_capability_equal", lambda c: capability == _capability(c))):
                stack.enter_context(mock.patch.object(fused_attention_stablehlo, name, test))
        yield


def _after_lowering(hook):
    """A patch of Pallas' jaxpr -> Triton module lowering that calls hook(module) on each module
    it lowers (to check it, or to set an attribute), while the patch is entered."""
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def run(*args, **kwargs):
        result = lower(*args, **kwargs)
        hook(result.module)
        return result

    return mock.patch.object(triton_lowering, "lower_jaxpr_to_triton_module", run)


@contextlib.contextmanager
def max_registers(count: int | None):
    """While the block runs, every Triton module Pallas lowers carries `ttg.maxnreg` = count,
    Triton's limit on registers per thread (PTX's .maxnreg), which Pallas-Triton's CompilerParams
    does not expose; None: none, as Pallas leaves it. Without a limit ptxas gave PaTH's kernel
    backward 32 registers and 19.6 KB of spills, with 255 it spills 3.8 KB (benchmarks/RESULTS.md).
    It acts when a function is lowered: jit's cache keeps what was lowered before."""
    if not count:
        yield
        return

    def limit(module):
        with module.context:
            module.operation.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), count)

    with _after_lowering(limit):
        yield


def _capability(text: str) -> int:
    major, minor = text.split(".")
    return 10 * int(major) + int(minor)


def exported_text(fn, *args, platform: str) -> str:
    """The StableHLO text of jit(fn)(*args) exported for `platform`, with its stand-in."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in UNSTABLE_CALLS]
    with target(platform):
        exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
    return exported.mlir_module()


def triton_kernels(text: str) -> list[dict]:
    """The Triton kernels of an exported module's text (Pallas on GPU), in the module's order:
    each one's name, num_warps, num_stages and Triton IR (the `tt` dialect, as text), read from
    its custom call's backend config, for a Triton compiler to take on this host."""
    from jax._src.lib.triton import dialect as tt_dialect

    kernels = []
    with jax_mlir.make_ir_context() as ctx:
        tt_dialect.register_dialect(ctx)

        def walk(op):
            for region in op.regions:
                for block in region:
                    for inner in block:
                        if (inner.name == "stablehlo.custom_call"
                                and ir.StringAttr(inner.attributes["call_target_name"]).value == TRITON):
                            config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                            kernels.append({"name": ir.StringAttr(config["name"]).value,
                                            "num_warps": ir.IntegerAttr(config["num_warps"]).value,
                                            "num_stages": ir.IntegerAttr(config["num_stages"]).value,
                                            "ttir": str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))})
                        walk(inner)

        walk(ir.Module.parse(text).operation)
    return kernels


def simplified(text: str) -> str:
    """The module after MLIR's canonicalize, symbol-dce and cse. Differentiating a
    `jax.lax.platform_dependent` joins the branches' residuals, so the branch lowered returns
    zeros in the slots of the others' (the CPU reference's T x T scores among them): dead code,
    which XLA removes before anything is allocated, and which these passes remove here."""
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse("builtin.module(canonicalize,symbol-dce,cse)").run(module.operation)
        return str(module)


# ---- compiling for a TPU topology on this host (libtpu, no TPU) -------------------------------

# Each generation's name in a topology (`v5e:2x2`) -> HBM per chip, in GiB.
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
TOPOLOGY = re.compile(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})")


class CompilerMissing(ValueError):
    """A compiler for an accelerator (libtpu, jax's CUDA plugin) is not installed here: the checks
    that compile for that accelerator cannot run (the tests skip them, with this line as the reason)."""


def compilers_dir() -> str:
    """Where `make` puts the compilers, off the import path: beside the interpreter's environment
    (<venv>/libtpu, <venv>/cuda), or POSITIONAL_COMPILERS."""
    return os.environ.get("POSITIONAL_COMPILERS", sys.prefix)


def compiler_missing(name: str, advice: str) -> CompilerMissing:
    """The one line for a missing compiler: the install's own line where `make` could not install
    it (<venv>/<name>.missing: which release, asked for by which JAX, and why), else `advice`."""
    note = os.path.join(compilers_dir(), f"{name}.missing")
    return CompilerMissing(open(note).read().strip() if os.path.isfile(note) else advice)


def require_compiler(platform: str) -> None:
    """One CompilerMissing line where the compiler for `platform` ("tpu": libtpu, "cuda": jax's
    CUDA plugin) is not installed here."""
    if platform == "tpu" and libtpu_path() is None:
        raise compiler_missing("libtpu", "compiling for TPU needs the TPU compiler (libtpu): run `make` (installs it "
                               "in .venv/libtpu) or `pip install -e '.[tpu]'`")
    if platform == "cuda" and cuda_plugin_path() is None and not plugin_on_path():
        raise compiler_missing("cuda", "compiling for GPU needs jax's CUDA plugin: run `make` (installs it in "
                               ".venv/cuda) or `pip install -e '.[cuda-compile]'`")


def libtpu_path() -> str | None:
    """The TPU compiler JAX will load: TPU_LIBRARY_PATH, an installed libtpu module, or the one
    `make` puts beside the interpreter's environment (<venv>/libtpu, off the import path)."""
    found = cloud_tpu_init.get_tpu_library_path()
    beside = os.path.join(compilers_dir(), "libtpu", "libtpu", "libtpu.so")
    return found or (beside if os.path.isfile(beside) else None)


def tpu_topology(name: str) -> list:
    """The devices of a TPU topology (`v4:2x2x1`, `v5e:2x2`, `v5p:2x2x4`, `v6e:2x2`), to lower and
    compile for with the TPU compiler on this host; one ValueError line for an unknown name or a
    missing libtpu."""
    if not TOPOLOGY.fullmatch(name):
        raise ValueError(f"unknown TPU topology {name!r}: pass <generation>:<chips per axis>, generation one "
                         f"of {', '.join(TPU_HBM_GIB)}, e.g. v4:2x2x1, v5e:2x2, v5p:2x2x4, v6e:2x2")
    jax.devices()  # this host's own backends first: with the library named, JAX would look for a TPU
    require_compiler("tpu")
    os.environ["TPU_LIBRARY_PATH"] = libtpu_path()
    # libtpu reads this host's TPU from these when it loads and, on a host without one, prints a
    # page of errors; they do not choose what is compiled for (the topology does). Its lock
    # file, which keeps a second process off a TPU, would stop two compiling processes.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        # v4 and v5p chips have two TensorCores, which JAX shows as one device ("megacore").
        options = {"chip_config_name": "megacore"} if name.split(":")[0] in ("v4", "v5p") else {}
        # Hosts of up to 2x2x1 chips (older libtpu refuses a topology smaller than its default host).
        shape = [int(n) for n in name.split(":")[1].split("x")] + [1]
        options["chips_per_host_bounds"] = tuple(min(n, most) for n, most in zip(shape, (2, 2, 1)))
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **options).devices)
    except Exception as e:  # noqa: BLE001 -- libtpu's own message, in one line
        raise ValueError(f"TPU topology {name!r}: {str(e).splitlines()[0]}") from None


# ---- compiling for GPUs on this host (XLA's GPU compiler through jax's CUDA plugin, no GPU) ----

# Each GPU's name in a topology (`h100:8`: one host of 8; `h100:2x8`: two) -> what XLA's GPU
# compiler is told of it: the name the driver gives, its memory as nvidia-smi reports it (MiB),
# its memory bandwidth (bytes/s) and L2 (MiB). Both are Hopper (sm_90, 132 SMs).
GPUS = {"h100": ("NVIDIA H100 80GB HBM3", 81_559, 3.35e12, 50), "h200": ("NVIDIA H200", 143_771, 4.8e12, 60)}
GPU_TOPOLOGY = re.compile(r"(h100|h200):(?:(\d+)x)?(\d+)")
CUDA_PLUGIN = "jax_plugins.xla_cuda13"


def gpu_target_config(gpu: str) -> str:
    """XLA's description of one GPU (a GpuTargetConfigProto, text format), for compiling without one."""
    name, mib, bandwidth, l2_mib = GPUS[gpu]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 registers_per_core_limit: 65536 registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)} l2_cache_size: {l2_mib * 2 ** 20} clock_rate_ghz: 1.98
  device_memory_size: {mib * 2 ** 20} cuda_compute_capability {{ major: 9 minor: 0 }}
}}
platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 10 }} device_description_str: "{name}"
"""


def plugin_on_path() -> bool:
    """Whether jax's CUDA plugin is importable (installed on the path: a GPU host's jax[cuda13])."""
    try:
        return importlib.util.find_spec(CUDA_PLUGIN) is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def cuda_plugin_path() -> str | None:
    """Where `make` puts jax's CUDA plugin with the compilers it calls (ptxas, libdevice):
    <venv>/cuda, off the import path (JAX would otherwise try to start a GPU at every run)."""
    beside = os.path.join(compilers_dir(), "cuda")
    return beside if os.path.isdir(os.path.join(beside, *CUDA_PLUGIN.split("."))) else None


def gpu_topology(name: str) -> list:
    """The devices of GPU hosts (`h100:8`, `h200:1`, `h100:2x8`: hosts x GPUs each), to lower and
    compile for with XLA's GPU compiler on this host; one ValueError line for an unknown name or
    no CUDA plugin."""
    match = GPU_TOPOLOGY.fullmatch(name)
    if not match:
        raise ValueError(f"unknown GPU topology {name!r}: pass <gpu>:[<hosts>x]<gpus per host>, gpu one of "
                         f"{', '.join(GPUS)}, e.g. h100:8, h200:1, h100:2x8")
    jax.devices()  # this host's own backends first
    require_compiler("cuda")
    path = cuda_plugin_path()
    if xla_bridge.canonicalize_platform("cuda") not in xla_bridge._topology_factories:
        if path is not None:  # its library, registered for its compiler alone (nothing imported)
            xla_bridge.register_plugin("cuda", priority=500, options=xla_client.generate_pjrt_gpu_plugin_options(),
                                       library_path=os.path.join(path, *CUDA_PLUGIN.split("."), "xla_cuda_plugin.so"))
        else:  # installed on the path but not started (no GPU): its checks of the CUDA libraries need one
            os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
            importlib.import_module(CUDA_PLUGIN).initialize()
    if path is not None and jax_lib.cuda_path is None:  # where XLA finds ptxas and libdevice
        jax_lib.cuda_path = os.path.join(path, "nvidia", "cu13")
    gpu, hosts, per_host = match[1], int(match[2] or 1), int(match[3])
    try:
        return list(topologies.get_topology_desc(name, platform="cuda", target_config=gpu_target_config(gpu),
                                                 topology=f"1x{hosts}x{per_host}").devices)
    except Exception as e:  # noqa: BLE001 -- the plugin's own message, in one line
        raise ValueError(f"GPU topology {name!r}: {str(e).splitlines()[0]}") from None


def topology_devices(name: str) -> list:
    """The devices of a TPU topology (`v5e:2x2`) or of GPU hosts (`h100:8`), compile-only; one
    ValueError line for a name that is neither."""
    if GPU_TOPOLOGY.fullmatch(name):
        return gpu_topology(name)
    if TOPOLOGY.fullmatch(name):
        return tpu_topology(name)
    raise ValueError(f"unknown topology {name!r}: pass a TPU topology <generation>:<chips per axis> (generation one "
                     f"of {', '.join(TPU_HBM_GIB)}: v4:2x2x1, v5e:2x2, v5p:2x2x4, v6e:2x2) or GPU hosts "
                     f"<gpu>:[<hosts>x]<gpus per host> (gpu one of {', '.join(GPUS)}: h100:8, h200:1, h100:2x8)")


def platform_of(topology: str) -> str:
    """The platform a topology's name is lowered for: "cuda" for GPU hosts, else "tpu"."""
    return "cuda" if GPU_TOPOLOGY.fullmatch(topology) else "tpu"


def compiled_for(fn, *args, topology: str = "v5e:1x1"):
    """jit(fn)(*args) compiled for one chip of `topology` (a TPU's through libtpu, a GPU's by
    XLA's GPU compiler), args ShapeDtypeStructs placed on it; the kernels are sized for that chip."""
    mesh = jax.sharding.Mesh(topology_devices(topology)[:1], ("x",))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())) for a in args]
    with target(platform_of(topology), mesh):
        return jax.jit(fn).lower(*placed).compile()


def hbm_per_device(name: str, devices: list) -> int:
    """Memory in bytes of one device of the topology: a GPU's, or a TPU chip's HBM (shared by
    its devices where a chip shows several)."""
    if GPU_TOPOLOGY.fullmatch(name):
        return GPUS[name.split(":")[0]][1] * 2 ** 20
    chips = math.prod(int(n) for n in name.split(":")[1].split("x"))
    return TPU_HBM_GIB[name.split(":")[0]] * 2 ** 30 * chips // len(devices)
