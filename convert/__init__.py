"""DeepSeek checkpoint -> layout v1 conversion (reads sources, quantizes, writes the layout)."""
