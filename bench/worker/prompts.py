"""The tinylm prompts the GPU checks continue greedily on both devices (in-process and through the mesh)."""

PROMPTS = [
    "The ", "def main():\n", "import os\nimport sys\n", "Return the", "class ", "The function",
    "If the", "This module", "for i in range(", "Python ", "An exception", "The default",
    "print(", "A list", "The value of", "When the", "while True:\n    ", "with open(",
    "Raises", "The object", "return ", "Note that", "See also", "# ",
]
