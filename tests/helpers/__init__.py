"""What the tests share: launching runs (launch.py), the flag sets they use (flags.py), the exact
numbers a profile of the tiny GPT must hold (tiny_gpt.py), and runs launched once per session
(profiled_runs.py, multinode.py)."""
