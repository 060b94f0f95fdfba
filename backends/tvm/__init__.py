"""The TVM lowering path: every kernel-level op as TensorIR, built by apache-tvm per target.

TVM only replaces kernel generation: the launch plan, memory planning, host checks and
states stay the native path's (plan.Plan run by runner.DeviceProgram). `llvm` kernels run
through the TVM runtime on numpy buffers; `cuda` and `opencl` kernels are device source
run by the same CuPy / pyopencl runtimes as the native kernels, with no TVM at load time.

tir.py (TVMScript text helpers) · lowering.py + ops_*.py (graph -> plan of PrimFuncs) ·
cpu_schedules.py (hand-written loop nests for CPUs) · nest_targets.py (what a nest takes from
llvm or from OpenCL C on a CPU device) · build.py (per-target builds,
dlight, device launches, disk cache) · host.py / cl_device.py
(run-time devices) · rocm_build.py (AMDGPU objects) · version.py (the pin) · backend.py.
"""
