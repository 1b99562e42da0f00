"""cuda_step"""
