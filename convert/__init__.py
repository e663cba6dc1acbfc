"""DeepSeek checkpoints into layout v1 (source/, names/, plan, transform, parts, resume) and back out (export/)."""
