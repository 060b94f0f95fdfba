"""The backend-comparison benchmark: which backend, how fast, how close to the machine's
limits, and how much DFlash buys (`dflash-bench`, and the pytest-benchmark files in bench/).

    limits    memory bandwidth (STREAM copy / triad) through each backend, peak f32 GEMM
    kernels   hot kernels at the shapes of Qwen3.5-9B and Qwen3.6-35B-A3B layers
    e2e       prefill, target-only decode and speculative tokens/s, tau, per backend and model
    tau       speculative tokens/s at chosen acceptance lengths (a scripted draft)
    serve     dflash-serve's aggregate tokens/s with 1, 2 and 4 clients
    peer      llama.cpp (llama-cpp-python) on the same GGUF
    scale     real-size models: compile, cold / warm load, peak RSS and speed, ours and llama.cpp's
"""
