"""PlainEngine: what the schedules use of DeepSpeed's engine, without an optimizer, so tests read
the gradients of an iteration before any step."""


class PlainEngine:
    def __init__(self, module, gas):
        self.module, self.gas = module, gas

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self):
        return self.gas

    def backward(self, loss, scale_wrt_gas=True):
        (loss / self.gas if scale_wrt_gas else loss).backward()

    def step(self):
        pass

    def get_global_grad_norm(self):
        return None

    def set_gradient_accumulation_boundary(self, flag):
        pass
