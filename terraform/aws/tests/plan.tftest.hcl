# Offline plan tests (terraform >= 1.7): the AWS provider is mocked, so no
# credentials or network are needed. Run: terraform init -backend=false && terraform test
mock_provider "aws" {
  mock_data "aws_ami" {
    defaults = {
      id               = "ami-0123456789abcdef0"
      root_device_name = "/dev/sda1"
    }
  }
  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }
}

variables {
  region             = "us-east-1"
  availability_zones = ["us-east-1a", "us-east-1b"]
  gpu_ami_id         = "ami-0123456789abcdef0"
}

run "defaults_are_private_and_locked_down" {
  command = plan

  assert {
    condition     = length(aws_subnet.private) == 2 && alltrue([for s in aws_subnet.private : s.map_public_ip_on_launch == false])
    error_message = "one private subnet per AZ, no public IPs"
  }
  assert {
    condition     = length(aws_vpc_security_group_ingress_rule.nodes_ssh) == 0
    error_message = "no SSH rule without admin_cidr"
  }
  assert {
    condition     = aws_launch_template.node.metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 must be required"
  }
  assert {
    condition     = aws_launch_template.node.block_device_mappings[0].ebs[0].encrypted == "true"
    error_message = "root volume must be encrypted"
  }
  assert {
    condition     = aws_placement_group.gang.strategy == "cluster"
    error_message = "cluster placement group"
  }
  assert {
    condition     = length(aws_iam_role_policy.node) == 0 && length(aws_iam_role_policy_attachment.ssm) == 0
    error_message = "the node role has no permissions by default"
  }
  assert {
    condition     = output.ami_id == "ami-0123456789abcdef0" && output.region == "us-east-1"
    error_message = "outputs echo the AMI and region"
  }
  assert {
    condition     = toset(keys(output.subnet_ids_by_az)) == toset(["us-east-1a", "us-east-1b"])
    error_message = "subnet_ids_by_az is keyed by AZ"
  }
}

run "admin_cidr_opens_ssh_only_from_it" {
  command = plan

  variables {
    admin_cidr            = "203.0.113.0/24"
    enable_ssm            = true
    checkpoint_bucket_arn = "arn:aws:s3:::ckpt"
  }

  assert {
    condition     = aws_vpc_security_group_ingress_rule.nodes_ssh[0].cidr_ipv4 == "203.0.113.0/24" && aws_vpc_security_group_ingress_rule.nodes_ssh[0].from_port == 22
    error_message = "SSH from admin_cidr only"
  }
  assert {
    condition     = length(aws_iam_role_policy.node) == 1 && length(aws_iam_role_policy_attachment.ssm) == 1
    error_message = "optional grants appear when asked for"
  }
}

run "rejects_open_admin_cidr" {
  command = plan

  variables {
    admin_cidr = "0.0.0.0/0"
  }

  expect_failures = [var.admin_cidr]
}

run "rejects_single_az" {
  command = plan

  variables {
    availability_zones = ["us-east-1a"]
  }

  expect_failures = [var.availability_zones]
}
