"""External oracle for DeepSeek-V4-Flash: transformers' ``DeepseekV4ForCausalLM`` on CPU.

The oracle runs in a separate Python 3.11 virtualenv (torch + transformers) as a subprocess;
``sideenv`` provisions that environment and runs ``hf_v4_oracle.py`` in it. Nothing in this
package imports torch into the main (JAX) environment.
"""
