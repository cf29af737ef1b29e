"""patchgen: generate readable, checked-in modeling files from upstream source plus a patch config."""
