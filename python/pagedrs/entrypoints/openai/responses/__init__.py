"""OpenAI's Responses API: protocol, serving, stored responses and their routes."""
