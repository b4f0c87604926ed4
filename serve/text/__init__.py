"""Text handling around the model: detokenization, stop strings and chat encoding/parsing.

* `detokenizer.IncrementalDetokenizer`: token ids -> text deltas, never a partial character.
* `stops.StopChecker`: stop-string matching across token boundaries, with hold-back.
* `chat`: DeepSeek V4 / V4.1 chat prompts -> token ids and generated ids -> content,
  reasoning and tool calls, through the official `deepseek-recipe` library.

Importing this package does not import `deepseek_recipe`; `chat` does.
"""

from deepinfer.serve.text.detokenizer import IncrementalDetokenizer
from deepinfer.serve.text.stops import StopChecker, StopUpdate

__all__ = ["IncrementalDetokenizer", "StopChecker", "StopUpdate"]
