"""Generation from a (sub-)model: text (with MTP self-speculation), images and clips (NFSP), speech (NCP)."""
