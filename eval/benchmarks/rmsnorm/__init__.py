"""The parts of eval/benchmarks/bench_norm.py, the one command that runs them (the timing stays in it):

  methods.py  the RMSNorm implementations it compares, plain and with the residual add
  checks.py   the correctness checks, apart from any timing: our kernels against fp32 references (--check) and
              the model with norm_impl="triton" against "eager" (--check_model)
"""
