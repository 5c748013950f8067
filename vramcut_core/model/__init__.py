"""The model as the engine sees it: its cut units (``units``: which blocks a forward is cut at,
the family registry), the bytes of its tensors (``tensors``) and its quantized weights taken
apart into plain tensors and rebuilt (``quant``). Imports torch only."""
