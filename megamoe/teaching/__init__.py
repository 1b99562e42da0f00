"""What the walkthrough notebooks (notebooks/) draw a fused kernel's execution with: nothing a check or a benchmark
runs imports it.

    anatomy.py     a kernel's anatomy from its plan: warps by role, shared memory, stages (FlashInfer MXFP4,
                   DeepGEMM FP8 and FP4)
    plans_viz.py   the pictures of it: warps, shared memory, the pipeline, the schedules
"""
