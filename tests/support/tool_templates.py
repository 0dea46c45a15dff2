"""Chat templates that offer tools, in three of the formats the tool-call parsers read (tests only).

Shortened from the shapes of the families' own templates: HERMES writes the tools in <tools> and
asks for <tool_call>{"name", "arguments"}</tool_call> (Qwen2.5, Hermes); LLAMA3_JSON writes them in
the user's turn and asks for {"name", "parameters"} (Llama 3.1), tool results under ipython;
QWEN3_CODER lists them as XML and asks for <tool_call><function=...><parameter=...> (Qwen3-Coder).
"""

from __future__ import annotations

HERMES = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3_JSON = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' and loop.last and tools %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nRespond with {"name": function name, "parameters": '
    'dictionary of argument name and its value}. Functions:\\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": '
    + call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

QWEN3_CODER = """{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content %}{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = 'You are a helpful assistant.' %}{%- set loop_messages = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools is iterable and tools | length > 0 %}
{{- '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
{{- '\\n<function>\\n<name>' ~ tool.name ~ '</name>' }}
{%- if tool.description is defined %}{{- '\\n<description>' ~ tool.description ~ '</description>' }}{%- endif %}
{{- '\\n<parameters>' }}
{%- if tool.parameters is defined and tool.parameters.properties is defined %}
{%- for name, fields in tool.parameters.properties | items %}
{{- '\\n<parameter>\\n<name>' ~ name ~ '</name>' }}
{%- if fields.type is defined %}{{- '\\n<type>' ~ fields.type ~ '</type>' }}{%- endif %}
{{- '\\n</parameter>' }}
{%- endfor %}
{%- endif %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply ONLY in this format:\\n\\n<tool_call>\\n<function=example_function_name>'
    '\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- for name, value in tool_call.arguments | items %}
{{- '<parameter=' + name + '>\\n' }}
{{- value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
