"""Adaptive draft length: oracle labels, the LDLP predictor, draft-length policies and their evaluation."""
