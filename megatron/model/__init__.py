from megatron.model.gpt_model import GPTModel, GPTModelPipe, gpt_loss

__all__ = ["GPTModel", "GPTModelPipe", "gpt_loss"]
