"""deepgemm_fp4"""
