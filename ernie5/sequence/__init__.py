"""The unified sequence: documents made of modality segments, their packing, and the media
documents of each modality."""
