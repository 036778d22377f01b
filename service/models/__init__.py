"""Model code for packed (ragged) batches."""
