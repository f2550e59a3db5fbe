# Placeholder: DeepSpeed copies its deepspeed/utils/zero_to_fp32.py recovery script here
# (engine._copy_recovery_script).  Readers must ignore this file.
