"""Using foak from your own HF Trainer or TRL SFTTrainer script.

Either patch the model before building the trainer::

    foak.patch(model, "foak.yaml", mixed_precision="bf16")
    trainer = Trainer(model=model, args=args, ...)

or let the trainer do it when it is created (the mixed precision is read from its TrainingArguments)::

    trainer = SFTTrainer(model=model, args=args, callbacks=[FoakCallback("foak.yaml")], ...)

TRL's trainers score the labels through their own fused LM head, past the model's loss: with
fused_linear_loss on, foak serves that head too (foak/integrations/trl.py; the rule's report row counts the
calls and names any that TRL's kernel ran).
"""

from __future__ import annotations

from transformers import TrainerCallback


class FoakCallback(TrainerCallback):
    """Patches the trainer's model with foak when the trainer is constructed and prints the report."""

    def __init__(self, config=None, **switches):
        from foak.config import config_from_kwargs, load_config

        if config is not None and switches:
            raise ValueError("FoakCallback: pass either a config or keyword switches, not both")
        # keyword switches are checked now and resolved against the model in on_init_end (as foak.patch does:
        # on a PEFT model they are the peft stanza's, where fused_lora is valid)
        self.config = load_config(config) if config is not None else None
        self.switches = dict(switches)
        if config is None:
            config_from_kwargs(**{"mode": "peft", **switches})
        self.report = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        import foak

        if model is None:
            raise ValueError("FoakCallback: the trainer passed no model to patch")
        mixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
        if self.config is not None:
            self.report = foak.patch(model, self.config, mixed_precision=mixed_precision)
        else:
            self.report = foak.patch(model, mixed_precision=mixed_precision, **self.switches)
        if state.is_world_process_zero:
            print(self.report)
