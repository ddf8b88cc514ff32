"""The ptckpt image format: construct records and the image directory's reader and writer.

Pure: nothing here touches ptrace or /proc.
"""
