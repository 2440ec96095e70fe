"""distrun-tp: Tensor parallel and 2D strategies for distrun."""
