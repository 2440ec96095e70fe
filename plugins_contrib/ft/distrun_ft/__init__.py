"""distrun-ft: replica groups that keep training when one dies (torchft), healed from a peer."""
