"""What the tests share: launching runs (launch.py), the flag sets they use (flags.py), the exact
numbers a profile of the tiny GPT and the tiny LLaMA must hold (tiny_gpt.py, tiny_llama.py), runs
launched once per session (profiled_runs.py, multinode.py), the demo corpus as datasets (corpus.py),
upstream's launch scripts as argument lists (upstream_scripts.py) and the start of the plain DeepSpeed
scripts in tests/scripts (deepspeed_script.py)."""
