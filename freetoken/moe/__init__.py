"""Where and how experts are placed and stored."""
