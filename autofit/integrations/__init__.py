"""A plan handed to the trainers people already use (docs/integrations.md).

- ``autofit.integrations.transformers``: ``AutofitTrainer``, a transformers ``Trainer`` that trains with a plan,
  and ``trainer_arguments(plan)``, the plan's values as ``TrainingArguments`` keyword arguments.
- ``autofit.integrations.lightning``: ``AutofitCallback``, a Lightning callback that applies a plan.
- ``autofit.integrations.trainer_args``: the run a ``TrainingArguments`` JSON (or a Lightning config) describes, for
  ``autofit plan --from-trainer-args``.

Each applies the plan through ``autofit.apply.apply_plan``, the one owner of the strategies, and refuses in one line
a plan lever its trainer cannot host, rather than train without it.
"""
