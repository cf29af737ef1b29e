"""Types every multimodal family shares with the data pipeline: the collate table (`collate`) and the token ids of
a video placeholder's layout (`video_tokens`). Family-specific rules (positions, video sampling) stay in the family
folders and are reached through their `veomni.models.family.DataRules`."""
