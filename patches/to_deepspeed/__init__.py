"""What DeepSpeed gets: one file per patch, each naming the DeepSpeed attributes it needs (`requires()`) and the gap
it closes; `patches.apply()` installs them."""
