"""The model card: TRL's, with this package's sections added (`builder`): the objective that ran (`objective`), the
configuration that acted (`fields`) and the quick start that loads the result (`quick_start`)."""

from .builder import add_to_model_card, extend_card

__all__ = ["add_to_model_card", "extend_card"]
