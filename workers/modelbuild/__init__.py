"""Build side (research/R&D): build and sign tinygrad model artifacts. Needs clang.

    python -m workers.modelbuild --out DIR [--key KEYFILE] [--seed N]

Never started by the supervisor: no ``main(ctx)``.
"""
